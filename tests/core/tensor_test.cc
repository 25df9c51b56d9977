// The dtype helpers of core/tensor.h and core/dump/compare.h, and host element access, for the
// int64 dtype of token ids and labels next to the four float dtypes.
#include "core/tensor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>

#include "core/dump/compare.h"

namespace mpusim {
namespace {

constexpr DType kFloats[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16};

TEST(DTypeTest, Int64IsAStorageDTypeButNotAFloat) {
  EXPECT_EQ(DTypeSize(DType::kInt64), 8u);
  EXPECT_EQ(DTypeName(DType::kInt64), "int64");
  EXPECT_EQ(DTypeFromName("int64"), DType::kInt64);
  EXPECT_FALSE(IsFloat(DType::kInt64));
  EXPECT_FALSE(IsHalf(DType::kInt64));
  for (DType d : kFloats) {
    EXPECT_TRUE(IsFloat(d)) << DTypeName(d);
    EXPECT_EQ(DTypeFromName(DTypeName(d)), d);
  }
  EXPECT_EQ(DTypeFromName("torch.int64"), std::nullopt);
  EXPECT_EQ(CheckedTensorBytes({3, 5}, DType::kInt64), 120u);
  EXPECT_EQ(Tensor::HostZeros({3, 5}, DType::kInt64).bytes(), 120u);
}

// Nothing computes on ids: the float-only helpers refuse int64 instead of picking a float.
TEST(DTypeTest, FloatOnlyHelpersRefuseInt64) {
  EXPECT_THROW(ComputeDType(DType::kInt64), std::invalid_argument);
  EXPECT_THROW(LessPrecise(DType::kInt64, DType::kFloat32), std::invalid_argument);
  EXPECT_THROW(LessPrecise(DType::kFloat64, DType::kInt64), std::invalid_argument);
  EXPECT_THROW(UnitRoundoff(DType::kInt64), std::invalid_argument);
  EXPECT_THROW(DefaultTolerance(DType::kInt64), std::invalid_argument);
  EXPECT_THROW(RequireFloat(DType::kInt64, "test"), std::invalid_argument);
  for (DType d : kFloats) {
    EXPECT_NO_THROW(RequireFloat(d, "test")) << DTypeName(d);
    EXPECT_EQ(ComputeDType(d), d == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32);
  }
}

TEST(HostValueTest, Int64ElementsRoundTripThroughDouble) {
  // Integers up to 2^53 are exact doubles; -2^63 and 2^62 are powers of two, exact too.
  const double values[] = {0, 1, -1, 50256, 0x1p53, -0x1p53, 0x1p62, -0x1p63};
  Tensor t = Tensor::HostZeros({8}, DType::kInt64);
  for (int64_t i = 0; i < 8; ++i) SetHostValue(t, i, values[i]);
  const int64_t* raw = t.data_as<int64_t>();
  EXPECT_EQ(raw[3], 50256);
  EXPECT_EQ(raw[4], int64_t{1} << 53);
  EXPECT_EQ(raw[6], int64_t{1} << 62);
  EXPECT_EQ(raw[7], std::numeric_limits<int64_t>::min());
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(HostValue(t, i), values[i]) << "element " << i;

  const Tensor wide = HostToFloat64(t);
  EXPECT_EQ(wide.dtype(), DType::kFloat64);
  EXPECT_EQ(wide.shape(), t.shape());
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(wide.data_as<double>()[i], values[i]);
}

TEST(HostValueTest, Int64RefusesWhatItCannotHold) {
  Tensor t = Tensor::HostZeros({1}, DType::kInt64);
  for (double bad : {0.5, -2.25, 0x1p63, 1e300, -0x1p64, std::nan(""),
                     std::numeric_limits<double>::infinity()}) {
    EXPECT_THROW(SetHostValue(t, 0, bad), std::invalid_argument) << bad;
    EXPECT_EQ(t.data_as<int64_t>()[0], 0) << "a refused value must not be stored";
  }
}

}  // namespace
}  // namespace mpusim
