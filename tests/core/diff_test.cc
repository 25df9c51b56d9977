// mpusim diff (core/dump/diff.h): hand-made dumps in a temp directory, written with the same
// safetensors writer and metadata format as `mpusim run --dump`.
//   - the same full tensor in different layouts (tp split with and without stride, dp batch
//     split, partial sums, replicated copies) reassembles bit-exactly and compares equal;
//   - a perturbed element, NaN/Inf, a shape change, a tensor in one side only fail, with the
//     right worst element and counts; float32 vs float64 passes under the float32 policy;
//   - every corrupt input we can think of is a Status from LoadDump (exit 2), and copies that
//     disagree are a Status from Assemble and a failed tensor in DiffDumps (exit 1).
// What it is not: a test of the CLI wrapper, or of dumps from real runs (no mpirun here).
#include "core/dump/diff.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/dump/safetensors.h"

namespace mpusim {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

// A float64 host tensor with element flat index e equal to fn(e).
Tensor Full(const Shape& shape, const std::function<double(int64_t)>& fn) {
  Tensor t = Tensor::HostZeros(shape, DType::kFloat64);
  for (int64_t e = 0; e < t.numel(); ++e) t.data_as<double>()[e] = fn(e);
  return t;
}

// Small integers and halves: exact in float32 and float64, so sums of them are too.
Tensor Ramp(const Shape& shape) {
  return Full(shape, [](int64_t e) { return static_cast<double>(e % 23) * 0.5 - 5.0; });
}

double At(const Tensor& t, int64_t e) { return HostValue(t, e); }

// The local piece of `full` under `spec`, converted to `dtype`.
Tensor LocalPiece(const Tensor& full, const ShardSpec& spec, DType dtype) {
  const Shape& full_shape = full.shape();
  const Shape local = LocalShape(spec, full_shape);
  Tensor out = Tensor::HostZeros(local, dtype);
  std::vector<int64_t> index(local.size(), 0);
  for (int64_t e = 0; e < out.numel(); ++e) {
    int64_t flat = 0;
    for (size_t d = 0; d < local.size(); ++d) {
      flat = flat * full_shape[d] + GlobalIndex(spec, static_cast<int>(d), full_shape[d], index[d]);
    }
    SetHostValue(out, e, full.data_as<double>()[flat]);
    for (size_t d = local.size(); d-- > 0;) {
      if (++index[d] < local[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

// The metadata string of `mpusim run --dump` (run/dump.cc ShardMetadataJson).
std::string SpecJson(const Shape& full_shape, const ShardSpec& s, bool partial_sum) {
  Json j;
  j["full_shape"] = full_shape;
  j["placements"] = Json::array();
  for (const Placement& p : s.placements) {
    j["placements"].push_back({{"axis", std::string(ShardAxisName(p.axis))},
                               {"dim", p.dim},
                               {"shards", p.shards},
                               {"index", p.index},
                               {"stride", p.stride}});
    if (p.load_balanced) j["placements"].back()["load_balanced"] = true;
  }
  if (partial_sum) j["partial_sum"] = true;
  return j.dump();
}

// A dump of tp * dp ranks, rank = dp_rank * tp + tp_rank (tp fastest, as Megatron orders
// them). Each Add* call gives every rank its piece of a full float64 tensor.
class DumpBuilder {
 public:
  DumpBuilder(int64_t tp, int64_t dp) : tp_(tp), dp_(dp), files_(static_cast<size_t>(tp * dp)) {
    for (int64_t r = 0; r < tp * dp; ++r) {
      file(r).metadata["mpusim"] =
          Json{{"rank", r}, {"tp_rank", r % tp}, {"dp_rank", r / tp}, {"backend", "cpu"}}.dump();
    }
    manifest_["schema_version"] = 2;
    manifest_["config"] = nullptr;
    manifest_["world_size"] = tp * dp;
    manifest_["backend"] = "cpu";
    // No run-level "dtype": each tensor's own dtype picks its tolerance unless a test sets one.
    manifest_["tensors"] = Json::array();
    manifest_["files"] = Json::array();
    for (int64_t r = 0; r < tp * dp; ++r) {
      file_names_.push_back(fmt::format("rank{:05d}.safetensors", r));
      manifest_["files"].push_back(file_names_.back());
    }
  }

  // Every rank holds the whole tensor.
  void Replicated(const std::string& name, const Tensor& full, DType dtype) {
    AddAll(name, full, dtype, [](int64_t, int64_t) { return ShardSpec{}; });
  }
  // A weight: split over tp on `dim` with `stride`, copied on every dp rank.
  void ModelSplit(const std::string& name, const Tensor& full, DType dtype, int dim,
                  int64_t stride = 1) {
    AddAll(name, full, dtype, [&](int64_t tp_rank, int64_t) {
      ShardSpec s;
      s.Split(ShardAxis::kTp, dim, tp_, tp_rank, stride);
      return s;
    });
  }
  // An activation: `batch_dim` split over dp, and `model_dim` over tp (-1: replicated on tp).
  void Activation(const std::string& name, const Tensor& full, DType dtype, int batch_dim,
                  int model_dim = -1, int64_t stride = 1) {
    AddAll(name, full, dtype, [&](int64_t tp_rank, int64_t dp_rank) {
      ShardSpec s;
      s.Split(ShardAxis::kDp, batch_dim, dp_, dp_rank);
      if (model_dim >= 0) s.Split(ShardAxis::kTp, model_dim, tp_, tp_rank, stride);
      return s;
    });
  }
  // An activation whose full value is the sum of the tp ranks' tensors: tp rank k > 0 holds
  // (e % 3) - 1 at element e, tp rank 0 the rest, so the exact sum is `full`.
  void PartialSum(const std::string& name, const Tensor& full, DType dtype, int batch_dim) {
    AddManifest(name, full.shape(), dtype);
    for (int64_t r = 0; r < tp_ * dp_; ++r) {
      const int64_t k = r % tp_;
      const double others = static_cast<double>(tp_ - 1);
      const Tensor summand = Full(full.shape(), [&](int64_t e) {
        const double small = static_cast<double>(e % 3) - 1.0;
        return k == 0 ? full.data_as<double>()[e] - others * small : small;
      });
      ShardSpec s;
      s.Split(ShardAxis::kDp, batch_dim, dp_, r / tp_);
      Put(r, name, LocalPiece(summand, s, dtype), SpecJson(full.shape(), s, true));
    }
  }
  // One rank's tensor with explicit metadata (for inconsistent dumps).
  void Put(int64_t rank, const std::string& name, Tensor local, std::string metadata) {
    file(rank).tensors.push_back({name, std::move(local)});
    file(rank).metadata[name] = std::move(metadata);
  }
  void AddManifest(const std::string& name, const Shape& shape, DType dtype) {
    manifest_["tensors"].push_back(
        {{"name", name}, {"full_shape", shape}, {"dtype", DTypeName(dtype)}});
  }

  SafetensorsFile& file(int64_t rank) { return files_[static_cast<size_t>(rank)]; }
  // The local tensor `name` of `rank` (to perturb a copy).
  Tensor& local(int64_t rank, const std::string& name) {
    for (NamedTensor& t : file(rank).tensors) {
      if (t.name == name) return t.tensor;
    }
    throw std::out_of_range(name);
  }
  Json& manifest() { return manifest_; }

  // Every rank's piece under spec_of(tp_rank, dp_rank).
  void AddAll(const std::string& name, const Tensor& full, DType dtype,
              const std::function<ShardSpec(int64_t, int64_t)>& spec_of) {
    AddManifest(name, full.shape(), dtype);
    for (int64_t r = 0; r < tp_ * dp_; ++r) {
      const ShardSpec s = spec_of(r % tp_, r / tp_);
      Put(r, name, LocalPiece(full, s, dtype), SpecJson(full.shape(), s, false));
    }
  }

  void Write(const fs::path& dir) const {
    fs::create_directories(dir);
    for (size_t r = 0; r < files_.size(); ++r) {
      const Status s = WriteSafetensors((dir / file_names_[r]).string(), files_[r]);
      if (!s.ok()) throw std::runtime_error(s.Message());
    }
    const Status s = WriteFileAtomically((dir / "manifest.json").string(), manifest_.dump(1));
    if (!s.ok()) throw std::runtime_error(s.Message());
  }

 private:
  int64_t tp_;
  int64_t dp_;
  std::vector<SafetensorsFile> files_;
  std::vector<std::string> file_names_;  // as written, whatever the manifest says
  Json manifest_;
};

class DiffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::temp_directory_path() /
            fmt::format("mpusim_diff_{}_{}", static_cast<long>(::getpid()), info->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  std::string Path(const std::string& name) const { return (root_ / name).string(); }

  Dump Load(const std::string& name) const {
    StatusOr<Dump> dump = LoadDump(Path(name));
    if (!dump.ok()) throw std::runtime_error(dump.status().Message());
    return std::move(dump).value();
  }

  DiffResult Diff(const std::string& a, const std::string& b,
                  const DiffOptions& options = {}) const {
    StatusOr<DiffResult> result = DiffDumps(Load(a), Load(b), options);
    if (!result.ok()) throw std::runtime_error(result.status().Message());
    return std::move(result).value();
  }

  // Writes `builder` as dump `name` and returns LoadDump's error (or "ok").
  std::string LoadError(const DumpBuilder& builder, const std::string& name = "bad") const {
    builder.Write(root_ / name);
    return LoadMessage(name);
  }
  std::string LoadMessage(const std::string& name) const {
    StatusOr<Dump> dump = LoadDump(Path(name));
    return dump.ok() ? "ok" : dump.status().Message();
  }

  fs::path root_;
};

const TensorDiff& Find(const DiffResult& r, const std::string& name) {
  for (const TensorDiff& d : r.tensors) {
    if (d.name == name) return d;
  }
  throw std::out_of_range(name);
}

// The tensors of a small MLP-like dump, by full value (shared by several tests).
struct Model {
  Tensor w_col = Ramp({8, 6});       // column-parallel weight, split on dim 0
  Tensor w_row = Ramp({6, 8});       // row-parallel weight, split on dim 1
  Tensor w_qkv = Ramp({8, 3});       // split on dim 0 with stride 2
  Tensor bias = Ramp({6});           // replicated
  Tensor act = Ramp({4, 4, 8});      // [s, B, h]: batch split, hidden split
  Tensor act_seq = Ramp({4, 4, 6});  // sequence split (dim 0) and batch split
  Tensor partial = Ramp({4, 4, 6});  // a partial sum
  Tensor tokens = Ramp({4, 4});      // batch split, float64
};

void AddModel(DumpBuilder& b, const Model& m, DType dtype) {
  b.ModelSplit("fc1.weight", m.w_col, dtype, 0);
  b.ModelSplit("fc2.weight", m.w_row, dtype, 1);
  b.ModelSplit("qkv.weight", m.w_qkv, dtype, 0, 2);
  b.Replicated("fc2.bias", m.bias, dtype);
  b.Activation("fc1.output", m.act, dtype, 1, 2);
  b.Activation("fc2.output", m.act_seq, dtype, 1, 0);
  b.PartialSum("fc2.input_grad", m.partial, dtype, 1);
  b.Activation("tokens", m.tokens, DType::kFloat64, 1);
}

std::vector<std::string> ModelNames() {
  return {"fc1.weight", "fc2.weight", "qkv.weight",     "fc2.bias",
          "fc1.output", "fc2.output", "fc2.input_grad", "tokens"};
}

TEST_F(DiffTest, IdenticalDumpsPass) {
  DumpBuilder b(2, 2);
  AddModel(b, Model{}, DType::kFloat32);
  b.Write(root_ / "a");
  b.Write(root_ / "b");
  const DiffResult r = Diff("a", "b");
  ASSERT_EQ(r.tensors.size(), ModelNames().size());
  for (size_t i = 0; i < r.tensors.size(); ++i) {
    const TensorDiff& d = r.tensors[i];
    EXPECT_EQ(d.name, ModelNames()[i]);
    EXPECT_TRUE(d.pass) << d.name << ": " << d.problem;
    EXPECT_TRUE(d.compared);
    EXPECT_EQ(d.max_abs, 0.0) << d.name;
    EXPECT_EQ(d.normalized, 0.0) << d.name;
    EXPECT_EQ(d.mismatches, 0);
  }
  EXPECT_EQ(r.passed, static_cast<int64_t>(ModelNames().size()));
  EXPECT_EQ(r.failed, 0);
  EXPECT_NE(DiffText(r).find("8 passed, 0 failed"), std::string::npos);
}

// The central property: every layout reassembles to the same bits, so every layout pair
// compares with zero error.
TEST_F(DiffTest, LayoutsReassembleToTheSameFullTensors) {
  const Model m;
  const std::vector<std::pair<int64_t, int64_t>> layouts = {{1, 1}, {2, 1}, {1, 2}, {2, 2}, {4, 1}};
  for (const auto& [tp, dp] : layouts) {
    DumpBuilder b(tp, dp);
    AddModel(b, m, DType::kFloat32);
    b.Write(root_ / fmt::format("t{}d{}", tp, dp));
  }
  const Dump reference = Load("t1d1");
  for (const auto& [tp, dp] : layouts) {
    SCOPED_TRACE(fmt::format("tp {} dp {}", tp, dp));
    const Dump dump = Load(fmt::format("t{}d{}", tp, dp));
    EXPECT_EQ(dump.tp_size(), tp);
    for (const std::string& name : ModelNames()) {
      StatusOr<Tensor> full = dump.Assemble(name);
      ASSERT_TRUE(full.ok()) << full.status().Message();
      StatusOr<Tensor> want = reference.Assemble(name);
      ASSERT_TRUE(want.ok()) << want.status().Message();
      ASSERT_EQ(full->shape(), want->shape()) << name;
      ASSERT_EQ(full->dtype(), DType::kFloat64);
      double norm = 0;
      for (int64_t e = 0; e < full->numel(); ++e) {
        ASSERT_EQ(At(*full, e), At(*want, e)) << name << " element " << e;
        norm += std::fabs(At(*want, e));
      }
      ASSERT_GT(norm, 0) << name;
    }
    StatusOr<DiffResult> r = DiffDumps(dump, reference, {});
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->failed, 0) << DiffText(*r);
  }
  // The reassembly against the values themselves, not only against another layout.
  StatusOr<Tensor> qkv = Load("t2d2").Assemble("qkv.weight");
  ASSERT_TRUE(qkv.ok());
  for (int64_t e = 0; e < m.w_qkv.numel(); ++e) EXPECT_EQ(At(*qkv, e), At(m.w_qkv, e));
  StatusOr<Tensor> partial = Load("t4d1").Assemble("fc2.input_grad");
  ASSERT_TRUE(partial.ok());
  for (int64_t e = 0; e < m.partial.numel(); ++e) EXPECT_EQ(At(*partial, e), At(m.partial, e));
}

// Metadata decides placement: a stride-2 split described as stride 1 puts rows in the wrong
// place, and the diff sees it.
TEST_F(DiffTest, WrongStrideMetadataFails) {
  const Tensor w = Ramp({8, 3});
  DumpBuilder good(2, 1);
  good.ModelSplit("w", w, DType::kFloat32, 0, 2);
  good.Write(root_ / "good");
  DumpBuilder lying(2, 1);
  lying.ModelSplit("w", w, DType::kFloat32, 0, 2);
  for (int64_t r = 0; r < 2; ++r) {
    ShardSpec s;
    s.Split(ShardAxis::kTp, 0, 2, r);
    lying.file(r).metadata["w"] = SpecJson(w.shape(), s, false);
  }
  lying.Write(root_ / "lying");
  const DiffResult r = Diff("lying", "good");
  EXPECT_FALSE(Find(r, "w").pass);
  // Stride 2: rank 0 holds rows [0 1 4 5], rank 1 [2 3 6 7]; read as stride 1, rows 0, 1,
  // 6, 7 still land right and rows 2..5 are swapped.
  const TensorDiff& d = Find(r, "w");
  EXPECT_EQ(d.mismatches, 4 * 3);
  EXPECT_GE(d.worst_index[0], 2);
  EXPECT_LE(d.worst_index[0], 5);
  EXPECT_EQ(r.failed, 1);
}

TEST_F(DiffTest, PerturbedElementFailsWithItsCoordinates) {
  const Model m;
  DumpBuilder expected(1, 1);
  AddModel(expected, m, DType::kFloat32);
  expected.Write(root_ / "b");
  Model perturbed;
  perturbed.act = Ramp({4, 4, 8});
  const int64_t flat = (3 * 4 + 2) * 8 + 5;  // [3, 2, 5]
  perturbed.act.data_as<double>()[flat] += 0.5;
  DumpBuilder actual(2, 2);
  AddModel(actual, perturbed, DType::kFloat32);
  actual.Write(root_ / "a");

  const DiffResult r = Diff("a", "b");
  const TensorDiff& d = Find(r, "fc1.output");
  EXPECT_FALSE(d.pass);
  EXPECT_EQ(d.mismatches, 1);
  EXPECT_EQ(d.elements, 128);
  EXPECT_EQ(d.worst_flat, flat);
  EXPECT_EQ(d.worst_index, (Shape{3, 2, 5}));
  EXPECT_EQ(d.worst_a, At(m.act, flat) + 0.5);
  EXPECT_EQ(d.worst_b, At(m.act, flat));
  EXPECT_EQ(d.max_abs, 0.5);
  EXPECT_NE(d.problem.find("1 of 128 elements"), std::string::npos) << d.problem;
  EXPECT_NE(d.problem.find("[3, 2, 5]"), std::string::npos) << d.problem;
  // Sample 2 is on dp rank 1, channel 5 on tp rank 1: world rank 1 * 2 + 1 of A.
  EXPECT_EQ(d.worst_ranks_a, (std::vector<int64_t>{3}));
  EXPECT_EQ(d.worst_ranks_b, (std::vector<int64_t>{0}));
  EXPECT_NE(DiffText(r).find("first to differ, in the order A's run produced its tensors: "
                             "fc1.output, worst element [3, 2, 5] on rank 3 of A (rank 0 of B)\n"),
            std::string::npos)
      << DiffText(r);
  EXPECT_EQ(r.failed, 1);
  EXPECT_EQ(r.passed, static_cast<int64_t>(ModelNames().size()) - 1);

  // Overrides loosen the policy; 0.5 <= 1 + 0 * |b| passes.
  DiffOptions loose;
  loose.atol = 1.0;
  loose.rtol = 0.0;
  EXPECT_EQ(Diff("a", "b", loose).failed, 0);
  EXPECT_EQ(Find(Diff("a", "b", loose), "fc1.output").tolerance.atol, 1.0);
}

// Dumps of checked runs carry each tensor's error budget (the check's allowance against the
// float64 reference): a pair is allowed the sum of both sides' budgets; a side without one,
// or an override on the command line, falls back to the per-dtype policy.
TEST_F(DiffTest, ErrorBudgetsOfBothSidesAddUp) {
  const Model m;
  Model perturbed;
  perturbed.act = Ramp({4, 4, 8});
  const int64_t flat = (3 * 4 + 2) * 8 + 5;
  perturbed.act.data_as<double>()[flat] += 0.01;  // far outside float32's 1e-5 + 1e-4 |b|
  const auto budgeted = [](DumpBuilder& b, double atol, double rtol) {
    for (Json& t : b.manifest()["tensors"]) t["budget"] = {{"atol", atol}, {"rtol", rtol}};
  };
  DumpBuilder expected(1, 1);
  AddModel(expected, m, DType::kFloat32);
  expected.Write(root_ / "b_plain");
  budgeted(expected, 0.004, 1e-6);
  expected.Write(root_ / "b");
  DumpBuilder actual(2, 2);
  AddModel(actual, perturbed, DType::kFloat32);
  actual.Write(root_ / "a_plain");
  budgeted(actual, 0.007, 2e-6);
  actual.Write(root_ / "a");

  // 0.01 <= 0.004 + 0.007 + 3e-6 |b|: within the two budgets.
  const DiffResult r = Diff("a", "b");
  const TensorDiff& d = Find(r, "fc1.output");
  EXPECT_TRUE(d.pass) << d.problem;
  EXPECT_TRUE(d.budgeted);
  EXPECT_DOUBLE_EQ(d.tolerance.atol, 0.011);
  EXPECT_DOUBLE_EQ(d.tolerance.rtol, 3e-6);
  EXPECT_EQ(d.tolerance.ntol, 0.0);
  EXPECT_EQ(r.failed, 0);
  EXPECT_NE(DiffText(r).find("8 of 8 tensors carry error budgets in both dumps"),
            std::string::npos)
      << DiffText(r);
  EXPECT_EQ(nlohmann::json::parse(DiffJson(r))["tensors"][4]["budgeted"], true);
  // One budget alone does not cover it.
  budgeted(actual, 0.005, 2e-6);
  actual.Write(root_ / "a_small");
  EXPECT_FALSE(Find(Diff("a_small", "b"), "fc1.output").pass);
  // Without a budget on either side: the float32 policy, which 0.01 fails.
  for (const auto& [a, b] : {std::pair{"a_plain", "b"}, std::pair{"a", "b_plain"}}) {
    const DiffResult result = Diff(a, b);
    const TensorDiff& plain = Find(result, "fc1.output");
    EXPECT_FALSE(plain.budgeted) << a << " " << b;
    EXPECT_FALSE(plain.pass) << a << " " << b;
    EXPECT_EQ(plain.tolerance.atol, 1e-5);
  }
  // An override replaces the budgets: the policy with rtol 0.5 (atol stays float32's 1e-5).
  DiffOptions rtol_only;
  rtol_only.rtol = 0.5;
  const DiffResult with_override = Diff("a", "b", rtol_only);
  const TensorDiff& overridden = Find(with_override, "fc1.output");
  EXPECT_FALSE(overridden.budgeted);
  EXPECT_EQ(overridden.tolerance.atol, 1e-5);
  EXPECT_EQ(overridden.tolerance.rtol, 0.5);
}

TEST_F(DiffTest, DefaultPolicyUsesTheLessPreciseDtype) {
  const DiffOptions none;
  const Tolerance f32 = DiffTolerance(DType::kFloat32, DType::kFloat64, none);
  EXPECT_EQ(f32.atol, 1e-5);
  EXPECT_EQ(f32.rtol, 1e-4);
  const Tolerance f32b = DiffTolerance(DType::kFloat64, DType::kFloat32, none);
  EXPECT_EQ(f32b.atol, 1e-5);
  const Tolerance f64 = DiffTolerance(DType::kFloat64, DType::kFloat64, none);
  EXPECT_EQ(f64.atol, 1e-12);
  EXPECT_EQ(f64.rtol, 1e-9);
  DiffOptions rtol_only;
  rtol_only.rtol = 0.5;
  const Tolerance mixed = DiffTolerance(DType::kFloat64, DType::kFloat64, rtol_only);
  EXPECT_EQ(mixed.atol, 1e-12);
  EXPECT_EQ(mixed.rtol, 0.5);
}

TEST_F(DiffTest, Float32AgainstFloat64PassesUnderTheFloat32Policy) {
  // 0.1 * k is not representable: float32 rounding differs by up to 2^-24 relative.
  const Tensor values = Full({16, 8}, [](int64_t e) { return 0.1 * static_cast<double>(e + 1); });
  DumpBuilder a(2, 1);
  a.ModelSplit("w", values, DType::kFloat32, 1);
  a.Write(root_ / "f32");
  DumpBuilder b(1, 1);
  b.ModelSplit("w", values, DType::kFloat64, 0);
  b.Write(root_ / "f64");
  const DiffResult r = Diff("f32", "f64");
  const TensorDiff& d = Find(r, "w");
  EXPECT_TRUE(d.pass) << d.problem;
  EXPECT_EQ(d.dtype_a, DType::kFloat32);
  EXPECT_EQ(d.dtype_b, DType::kFloat64);
  EXPECT_EQ(d.tolerance.rtol, 1e-4);
  EXPECT_GT(d.max_abs, 0.0);                   // the rounding is there...
  EXPECT_LE(d.max_rel, std::ldexp(1.0, -24));  // ...and no larger than float32's unit roundoff
  EXPECT_GT(d.normalized, 0.0);
  EXPECT_LT(d.normalized, 1e-7);

  // The same rounding between two float64 dumps is far outside the float64 policy.
  DumpBuilder rounded(1, 1);
  rounded.ModelSplit(
      "w",
      Full({16, 8},
           [&](int64_t e) { return static_cast<double>(static_cast<float>(At(values, e))); }),
      DType::kFloat64, 0);
  rounded.Write(root_ / "rounded64");
  EXPECT_FALSE(Find(Diff("rounded64", "f64"), "w").pass);

  // A real error in a float32 dump (1e-3 relative) fails under the float32 policy.
  DumpBuilder wrong(1, 1);
  wrong.ModelSplit("w", Full({16, 8}, [&](int64_t e) { return At(values, e) * 1.001; }),
                   DType::kFloat32, 0);
  wrong.Write(root_ / "wrong");
  EXPECT_FALSE(Find(Diff("wrong", "f64"), "w").pass);
}

TEST_F(DiffTest, NanAndInfAreCountedAndFail) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  Tensor with_a = Ramp({4, 6});
  with_a.data_as<double>()[7] = nan;
  with_a.data_as<double>()[9] = -inf;
  Tensor with_b = Ramp({4, 6});
  with_b.data_as<double>()[20] = nan;
  DumpBuilder a(2, 1);
  a.ModelSplit("w", with_a, DType::kFloat32, 1);
  a.ModelSplit("clean", Ramp({4}), DType::kFloat32, 0);
  a.Write(root_ / "a");
  DumpBuilder b(1, 1);
  b.ModelSplit("w", with_b, DType::kFloat32, 1);
  b.ModelSplit("clean", Ramp({4}), DType::kFloat32, 0);
  b.Write(root_ / "b");
  const DiffResult r = Diff("a", "b");
  const TensorDiff& d = Find(r, "w");
  EXPECT_FALSE(d.pass);
  EXPECT_EQ(d.nan_a, 1);
  EXPECT_EQ(d.inf_a, 1);
  EXPECT_EQ(d.nan_b, 1);
  EXPECT_EQ(d.inf_b, 0);
  EXPECT_EQ(d.mismatches, 3);
  EXPECT_EQ(d.worst_flat, 7);  // the first non-finite element
  EXPECT_TRUE(std::isnan(d.worst_a));
  EXPECT_EQ(d.max_abs, 0.0);  // the finite elements agree
  EXPECT_NE(d.problem.find("1 NaN in A, 1 Inf in A, 1 NaN in B"), std::string::npos) << d.problem;
  EXPECT_TRUE(Find(r, "clean").pass);
  // JSON has no NaN: the worst value is the string "nan".
  const Json j = Json::parse(DiffJson(r));
  EXPECT_EQ(j["tensors"][0]["worst"]["a"], "nan");
  EXPECT_EQ(j["tensors"][0]["nan_a"], 1);
}

TEST_F(DiffTest, TensorsInOneSideOnlyFail) {
  DumpBuilder a(1, 1);
  a.Replicated("x", Ramp({3}), DType::kFloat32);
  a.Replicated("y", Ramp({3}), DType::kFloat32);
  a.Write(root_ / "a");
  DumpBuilder b(2, 1);
  b.Replicated("y", Ramp({3}), DType::kFloat32);
  b.Replicated("z", Ramp({2}), DType::kFloat64);
  b.Write(root_ / "b");
  const DiffResult r = Diff("a", "b");
  ASSERT_EQ(r.tensors.size(), 3u);
  EXPECT_EQ(r.tensors[0].name, "x");
  EXPECT_EQ(r.tensors[0].problem, "only in A");
  EXPECT_FALSE(r.tensors[0].dtype_b.has_value());
  EXPECT_TRUE(r.tensors[1].pass);
  EXPECT_EQ(r.tensors[2].name, "z");
  EXPECT_EQ(r.tensors[2].problem, "only in B");
  EXPECT_EQ(r.tensors[2].shape, (Shape{2}));
  EXPECT_EQ(r.failed, 2);
  EXPECT_EQ(r.passed, 1);
  const Json j = Json::parse(DiffJson(r));
  EXPECT_EQ(j["schema_version"], 1);
  EXPECT_EQ(j["failed"], 2);
  EXPECT_TRUE(j["tensors"][0]["dtype_b"].is_null());
  EXPECT_TRUE(j["tensors"][0]["max_abs"].is_null());
  EXPECT_EQ(j["tensors"][1]["problem"], nullptr);
  EXPECT_EQ(j["tensors"][1]["pass"], true);

  // --tensors: only the named ones; a name in neither dump is an error listing the others.
  DiffOptions only_y;
  only_y.tensors = {"y"};
  const DiffResult just_y = Diff("a", "b", only_y);
  ASSERT_EQ(just_y.tensors.size(), 1u);
  EXPECT_EQ(just_y.failed, 0);
  DiffOptions unknown;
  unknown.tensors = {"y", "nope"};
  StatusOr<DiffResult> bad = DiffDumps(Load("a"), Load("b"), unknown);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().where(), "tensors");
  EXPECT_NE(bad.status().what().find("'nope'"), std::string::npos);
  EXPECT_NE(bad.status().what().find("x, y, z"), std::string::npos) << bad.status().what();
}

TEST_F(DiffTest, ShapeMismatchFails) {
  DumpBuilder a(1, 1);
  a.Replicated("w", Ramp({4, 6}), DType::kFloat32);
  a.Write(root_ / "a");
  DumpBuilder b(1, 1);
  b.Replicated("w", Ramp({6, 4}), DType::kFloat32);
  b.Write(root_ / "b");
  const TensorDiff d = Find(Diff("a", "b"), "w");
  EXPECT_FALSE(d.pass);
  EXPECT_FALSE(d.compared);
  EXPECT_EQ(d.problem, "shape [4, 6] in A but [6, 4] in B");
  // The report says why shapes differ and what to diff instead.
  EXPECT_NE(DiffText(Diff("a", "b")).find("1 tensor differs in shape, so the two runs did not "
                                          "compute the same tensors"),
            std::string::npos)
      << DiffText(Diff("a", "b"));
}

TEST_F(DiffTest, BadOverridesAreErrors) {
  DumpBuilder a(1, 1);
  a.Replicated("w", Ramp({2}), DType::kFloat32);
  a.Write(root_ / "a");
  DiffOptions negative;
  negative.atol = -1;
  StatusOr<DiffResult> r = DiffDumps(Load("a"), Load("a"), negative);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().where(), "atol");
  DiffOptions not_a_number;
  not_a_number.rtol = std::numeric_limits<double>::quiet_NaN();
  r = DiffDumps(Load("a"), Load("a"), not_a_number);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().where(), "rtol");
  DiffOptions infinite;
  infinite.ntol = std::numeric_limits<double>::infinity();
  r = DiffDumps(Load("a"), Load("a"), infinite);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().where(), "ntol");
}

// A bfloat16 dump against float64: the bfloat16 policy (scaled to max|b|) accepts its
// rounding, the float32 policy does not, and the manifest's storage dtype makes a float32
// tensor of a bfloat16 run count as bfloat16.
TEST_F(DiffTest, SixteenBitDumpsUseTheirPrecision) {
  const Tensor values = Full({16, 8}, [](int64_t e) { return 0.1 * static_cast<double>(e - 60); });
  DumpBuilder a(2, 1);
  a.ModelSplit("w", values, DType::kBFloat16, 0);
  a.Replicated("g", Full({8}, [](int64_t e) { return 0.01 * static_cast<double>(e); }),
               DType::kFloat32);
  a.manifest()["dtype"] = "bfloat16";
  a.Write(root_ / "bf16");
  DumpBuilder b(1, 1);
  b.ModelSplit("w", values, DType::kFloat64, 0);
  b.Replicated("g", Full({8}, [](int64_t e) { return 0.0101 * static_cast<double>(e); }),
               DType::kFloat64);
  b.Write(root_ / "f64");
  const DiffResult r = Diff("bf16", "f64");
  const TensorDiff& w = Find(r, "w");
  EXPECT_TRUE(w.pass) << w.problem;
  EXPECT_EQ(w.precision, DType::kBFloat16);
  EXPECT_GT(w.max_rel, 0x1p-10);  // bfloat16 rounding is visible...
  EXPECT_LE(w.max_rel, 0x1p-8);   // ...and within its unit roundoff
  const TensorDiff& g = Find(r, "g");  // 1% off: inside bfloat16's 2^-5, outside float32's
  EXPECT_EQ(g.dtype_a, DType::kFloat32);
  EXPECT_EQ(g.precision, DType::kBFloat16);
  EXPECT_TRUE(g.pass) << g.problem;
  DiffOptions float32_policy;
  float32_policy.ntol = 0;
  float32_policy.rtol = 1e-4;
  float32_policy.atol = 1e-5;
  StatusOr<DiffResult> strict = DiffDumps(Load("bf16"), Load("f64"), float32_policy);
  ASSERT_TRUE(strict.ok());
  EXPECT_FALSE(Find(*strict, "w").pass);
  EXPECT_FALSE(Find(*strict, "g").pass);
}

// Copies of one shard on several ranks (a tp shard on every dp rank, a replicated tensor)
// must bit-agree. A disagreement is a defect of the run that made the dump: Assemble refuses
// it naming both ranks, and the diff reports the tensor as failed.
TEST_F(DiffTest, ReplicatedCopiesThatDisagreeAreReported) {
  DumpBuilder b(2, 2);
  b.ModelSplit("w", Ramp({4, 6}), DType::kFloat32, 0);
  b.Replicated("bias", Ramp({6}), DType::kFloat32);
  b.Replicated("ok", Ramp({6}), DType::kFloat32);
  // Rank 2 is (tp 0, dp 1): its copy of tp shard 0 differs from rank 0's at local [1, 4].
  b.local(2, "w").data_as<float>()[1 * 6 + 4] += 1.0f;
  b.local(3, "bias").data_as<float>()[5] = -0.0f;  // -0.0 == 0.0 but not the same bits
  b.Write(root_ / "a");
  const Dump dump = Load("a");  // structurally fine
  StatusOr<Tensor> w = dump.Assemble("w");
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().where(), "w");
  EXPECT_NE(w.status().what().find("ranks 0 and 2"), std::string::npos) << w.status().what();
  EXPECT_NE(w.status().what().find("the piece tp index 0 of 2"), std::string::npos)
      << w.status().what();
  EXPECT_NE(w.status().what().find("1 of 12 elements"), std::string::npos) << w.status().what();
  EXPECT_NE(w.status().what().find("[1, 4]"), std::string::npos) << w.status().what();

  DumpBuilder clean(1, 1);
  clean.ModelSplit("w", Ramp({4, 6}), DType::kFloat32, 0);
  clean.Replicated("bias", Ramp({6}), DType::kFloat32);
  clean.Replicated("ok", Ramp({6}), DType::kFloat32);
  clean.Write(root_ / "b");
  const DiffResult r = Diff("a", "b");
  EXPECT_FALSE(Find(r, "w").pass);
  EXPECT_EQ(Find(r, "w").problem.rfind("A: ranks 0 and 2", 0), 0u) << Find(r, "w").problem;
  EXPECT_FALSE(Find(r, "bias").pass);
  EXPECT_NE(Find(r, "bias").problem.find("ranks 0 and 3"), std::string::npos);
  EXPECT_TRUE(Find(r, "ok").pass);
  EXPECT_EQ(r.failed, 2);
}

// ---- Unreadable or inconsistent dumps: LoadDump returns a Status (the CLI exits 2). ----

DumpBuilder GoodDump() {
  DumpBuilder b(2, 1);
  b.ModelSplit("w", Ramp({4, 6}), DType::kFloat32, 0);
  b.Activation("act", Ramp({2, 2, 4}), DType::kFloat32, 1, 2);
  return b;
}

void ExpectContains(const std::string& message, const std::string& part) {
  EXPECT_NE(message.find(part), std::string::npos) << "message: " << message;
}

TEST_F(DiffTest, GoodDumpLoads) { EXPECT_EQ(LoadError(GoodDump()), "ok"); }

TEST_F(DiffTest, MissingDirectoryOrManifest) {
  ExpectContains(LoadMessage("nothing_here"), "no such directory");
  fs::create_directories(root_ / "empty");
  ExpectContains(LoadMessage("empty"), "manifest.json: cannot be read");
}

TEST_F(DiffTest, ManifestNotJson) {
  GoodDump().Write(root_ / "bad");
  ASSERT_TRUE(WriteFileAtomically(Path("bad/manifest.json"), "{\"schema_version\": 2,").ok());
  ExpectContains(LoadMessage("bad"), "invalid JSON");
}

TEST_F(DiffTest, ManifestFieldsAreChecked) {
  {
    DumpBuilder b = GoodDump();
    b.manifest()["schema_version"] = 3;
    ExpectContains(LoadError(b), "schema_version: must be 2");
  }
  {
    DumpBuilder b = GoodDump();
    b.manifest()["schema_version"] = 1;
    ExpectContains(LoadError(b), "schema_version: 1 is the dump format before shard placements");
  }
  {
    DumpBuilder b = GoodDump();
    b.manifest().erase("files");
    ExpectContains(LoadError(b), "files: is missing");
  }
  {
    DumpBuilder b = GoodDump();
    b.manifest()["world_size"] = 3;
    ExpectContains(LoadError(b), "list of world_size (3) file names");
  }
  {
    DumpBuilder b = GoodDump();
    b.manifest()["files"][1] = "../rank00001.safetensors";
    ExpectContains(LoadError(b), "without '/'");
  }
  {
    DumpBuilder b = GoodDump();
    b.manifest()["tensors"][0]["full_shape"] = Json::array({4, -6});
    ExpectContains(LoadError(b), "tensors[0].full_shape");
  }
  for (const Json& bad : {Json{{"atol", -1.0}, {"rtol", 0.0}}, Json{{"atol", 1.0}},
                          Json{{"atol", 1.0}, {"rtol", "x"}},
                          Json{{"atol", 1.0}, {"rtol", 0.0}, {"ntol", 0.0}}, Json(3)}) {
    DumpBuilder b = GoodDump();
    b.manifest()["tensors"][0]["budget"] = bad;
    ExpectContains(LoadError(b), "tensors[0].budget: must be {\"atol\": A, \"rtol\": R} with finite "
                                 "A, R >= 0, got");
  }
  {
    DumpBuilder b = GoodDump();
    b.manifest()["tensors"][0]["dtype"] = "int8";
    ExpectContains(LoadError(b), "tensors[0].dtype");
  }
  {
    // int64 is a dtype of the simulator (token ids) but never of a dump.
    DumpBuilder b = GoodDump();
    b.manifest()["tensors"][0]["dtype"] = "int64";
    ExpectContains(LoadError(b), "tensors[0].dtype");
  }
  {
    DumpBuilder b = GoodDump();
    b.manifest()["dtype"] = "fp8";
    ExpectContains(LoadError(b), "manifest.json: dtype: must be \"float32\", \"float64\", "
                                 "\"bfloat16\" or \"float16\", got");
  }
  {
    DumpBuilder b = GoodDump();
    b.AddManifest("ghost", {2}, DType::kFloat32);
    ExpectContains(LoadError(b), "tensor 'ghost': is in the manifest but in no rank file");
  }
  {
    DumpBuilder b = GoodDump();
    b.manifest()["tensors"].erase(1);
    ExpectContains(LoadError(b), "tensor 'act': is not in the manifest");
  }
  {
    DumpBuilder b = GoodDump();
    b.manifest()["tensors"][0]["dtype"] = "float64";
    ExpectContains(LoadError(b), "tensor 'w': dtype float32 but the manifest says float64");
  }
}

TEST_F(DiffTest, MissingOrTruncatedRankFile) {
  GoodDump().Write(root_ / "missing");
  fs::remove(root_ / "missing" / "rank00001.safetensors");
  ExpectContains(LoadMessage("missing"), "rank00001.safetensors: file: cannot open");

  GoodDump().Write(root_ / "truncated");
  const fs::path file = root_ / "truncated" / "rank00001.safetensors";
  fs::resize_file(file, fs::file_size(file) - 5);
  const std::string message = LoadMessage("truncated");
  ExpectContains(message, "rank00001.safetensors");
  EXPECT_NE(message, "ok");
}

TEST_F(DiffTest, RankMetadataIsChecked) {
  {
    DumpBuilder b = GoodDump();
    b.file(1).metadata.erase("mpusim");
    ExpectContains(LoadError(b), "missing key 'mpusim'");
  }
  {
    DumpBuilder b = GoodDump();
    b.file(1).metadata["mpusim"] = R"({"rank": 0, "tp_rank": 1, "dp_rank": 0})";
    ExpectContains(LoadError(b), "rank 0, but the manifest lists this file as files[1]");
  }
  {
    DumpBuilder b = GoodDump();
    b.file(1).metadata["mpusim"] = R"({"rank": 1, "tp_rank": "1", "dp_rank": 0})";
    ExpectContains(LoadError(b), "tp_rank must be an integer >= 0");
  }
}

TEST_F(DiffTest, ShardMetadataIsChecked) {
  const Shape full{4, 6};
  ShardSpec rank1;  // the GoodDump spec of w on rank 1
  rank1.Split(ShardAxis::kTp, 0, 2, 1);
  // w's metadata on rank 1 with its one placement's fields replaced by `fields`.
  auto placement = [](const std::string& fields) {
    return R"({"full_shape":[4,6],"placements":[{)" + fields + "}]}";
  };
  auto with_w_metadata = [&](const std::string& text) {
    DumpBuilder b = GoodDump();
    b.file(1).metadata["w"] = text;
    return LoadError(b);
  };
  ExpectContains(with_w_metadata("{\"full_shape\": [4, 6],"), "__metadata__.w: line 1, column 23: invalid JSON");
  ExpectContains(with_w_metadata("[1, 2]"), "__metadata__.w: must be a JSON object");
  // The well-formed text loads (so each case below fails for its one defect).
  {
    DumpBuilder b = GoodDump();
    b.file(1).metadata["w"] = placement(R"("axis":"tp","dim":0,"shards":2,"index":1,"stride":1)");
    b.Write(root_ / "well_formed");
    EXPECT_TRUE(LoadDump((root_ / "well_formed").string()).ok());
  }
  ExpectContains(
      with_w_metadata(placement(R"("axis":"tp","dim":0,"shards":2,"index":2,"stride":1)")),
      "placement 0 (tp): index 2 is outside [0, 2)");
  ExpectContains(
      with_w_metadata(placement(R"("axis":"tp","dim":0,"shards":3,"index":1,"stride":1)")),
      "not divisible by shards 3");
  ExpectContains(
      with_w_metadata(placement(R"("axis":"tp","dim":2,"shards":2,"index":1,"stride":1)")),
      "placements[0].dim 2 is outside [0, 2)");
  ExpectContains(
      with_w_metadata(placement(R"("axis":"pp","dim":0,"shards":2,"index":1,"stride":1)")),
      "placements[0].axis must be one of tp, dp, cp, ep, etp, got \"pp\"");
  ExpectContains(with_w_metadata(placement(R"("axis":"tp","dim":0,"shards":2,"index":1,"stride":1,)"
                                           R"("sharding":"fancy")")),
                 "placements[0]: unknown key 'sharding'");
  ExpectContains(with_w_metadata(placement(R"("axis":"tp","dim":0,"shards":2,"index":1)")),
                 "placements[0]: missing key 'stride'");
  ExpectContains(with_w_metadata(placement(R"("axis":"cp","dim":0,"shards":2,"index":1,"stride":1,)"
                                           R"("load_balanced":1)")),
                 "placements[0].load_balanced must be true or false, got 1");
  ExpectContains(with_w_metadata(placement(R"("axis":"cp","dim":0,"shards":4,"index":1,"stride":1,)"
                                           R"("load_balanced":true)")),
                 "is not divisible by 2 * shards 4 (load-balanced)");
  ExpectContains(
      with_w_metadata(placement(R"("axis":"tp","dim":0,"shards":2,"index":1,"stride":1.0)")),
      "placements[0].stride must be an integer");
  ExpectContains(
      with_w_metadata(placement(R"("axis":"tp","dim":0,"shards":0,"index":0,"stride":1)")),
      "shards 0 and stride 1 must be >= 1");
  ExpectContains(with_w_metadata(R"({"full_shape":[4,6],"placements":[)"
                                 R"({"axis":"tp","dim":0,"shards":2,"index":1,"stride":1},)"
                                 R"({"axis":"tp","dim":1,"shards":2,"index":1,"stride":1}]})"),
                 "placement 1 (tp): axis tp is used by placement 0 already");
  ExpectContains(with_w_metadata(R"({"full_shape":[4,6],"placements":{"axis":"tp"}})"),
                 "placements must be a list of at most 4 objects");
  ExpectContains(with_w_metadata(R"({"full_shape":[4,6]})"), "missing key 'placements'");
  ExpectContains(with_w_metadata(R"({"full_shape":[4,6],"shard_dim":0,"num_shards":2,)"
                                 R"("shard_index":1,"stride":1})"),
                 "unknown key 'shard_dim'");
  ExpectContains(with_w_metadata(R"({"full_shape":[4,6],"partial_sum":true,"placements":[)"
                                 R"({"axis":"tp","dim":0,"shards":2,"index":1,"stride":1}]})"),
                 "cannot also be split");
  ExpectContains(with_w_metadata(placement(R"("axis":"tp","dim":0,"shards":9223372036854775807,)"
                                           R"("index":1,"stride":9223372036854775807)")),
                 "not divisible");
  // full_shape that disagrees with the manifest, and a local shape the spec does not imply.
  ExpectContains(with_w_metadata(SpecJson({8, 6}, rank1, false)),
                 "full_shape [8, 6] but the manifest says [4, 6]");
  const ShardSpec whole;
  ExpectContains(with_w_metadata(SpecJson(full, whole, false)),
                 "shape [2, 6], but a shard of [4, 6]");
  {
    DumpBuilder b = GoodDump();
    b.file(1).metadata.erase("w");
    ExpectContains(LoadError(b), "tensor 'w': has no sharding metadata");
  }
  {
    DumpBuilder b = GoodDump();
    b.file(1).metadata["stray"] = SpecJson(full, rank1, false);
    ExpectContains(LoadError(b), "__metadata__.stray: describes a tensor that is not in the file");
  }
}

TEST_F(DiffTest, LayoutMustBeOneAndComplete) {
  {
    // Rank 1 claims a stride-2 split while rank 0 says stride 1.
    DumpBuilder b = GoodDump();
    ShardSpec s;
    s.Split(ShardAxis::kTp, 0, 2, 1, 2);
    b.file(1).metadata["w"] = SpecJson({4, 6}, s, false);
    ExpectContains(LoadError(b), "layout (tp: dim 0, 2 shards, stride 2)");
  }
  {
    // Both ranks claim shard 0: shard 1 is missing, so rows 2..3 are not covered.
    DumpBuilder b = GoodDump();
    ShardSpec s;
    s.Split(ShardAxis::kTp, 0, 2, 0);
    b.file(1).metadata["w"] = SpecJson({4, 6}, s, false);
    ExpectContains(LoadError(b), "tensor 'w': the piece tp index 1 of 2 is in no rank file");
  }
  {
    // A partial sum needs a summand from every tp rank.
    DumpBuilder b(2, 1);
    b.PartialSum("g", Ramp({2, 2, 3}), DType::kFloat32, 1);
    b.Replicated("r", Ramp({3}), DType::kFloat32);
    auto& tensors = b.file(1).tensors;
    tensors.erase(tensors.begin());
    b.file(1).metadata.erase("g");
    ExpectContains(LoadError(b), "tensor 'g': the summand of tp_rank 1 is in no rank file");
  }
  {
    // dp 2, but the dp index 1 slice was never written.
    DumpBuilder b(1, 2);
    b.Activation("x", Ramp({2, 4, 3}), DType::kFloat32, 1);
    ShardSpec s;
    s.Split(ShardAxis::kDp, 1, 2, 0);
    b.file(1).metadata["x"] = SpecJson({2, 4, 3}, s, false);
    ExpectContains(LoadError(b), "the piece dp index 1 of 2 is in no rank file");
  }
  {
    // A partial sum split over dp: the dp 1 summand of tp_rank 1 is missing.
    DumpBuilder b(2, 2);
    b.PartialSum("g", Ramp({2, 2, 3}), DType::kFloat32, 1);
    b.Replicated("r", Ramp({3}), DType::kFloat32);
    auto& tensors = b.file(3).tensors;
    tensors.erase(tensors.begin());
    b.file(3).metadata.erase("g");
    ExpectContains(LoadError(b),
                   "tensor 'g': the summand of tp_rank 1 (dp index 1 of 2) is in no rank file");
  }
}

// Two placements on one dimension: the sequence of [s, b, h] split over cp (the outer
// placement), each cp piece split again over tp, with a stride-2 tp split of h on top --
// the shape context parallelism will give activations.
TEST_F(DiffTest, NestedPlacementsOnOneDimensionReassemble) {
  const Tensor x = Ramp({8, 2, 4});
  auto nested = [](int64_t tp_rank, int64_t cp_rank) {
    ShardSpec s;
    s.Split(ShardAxis::kCp, 0, 2, cp_rank).Split(ShardAxis::kTp, 0, 2, tp_rank);
    return s;
  };
  // Global rows of (tp 1, cp 0): cp 0 holds rows 0..3, its tp 1 piece rows 2..3.
  EXPECT_EQ(GlobalIndex(nested(1, 0), 0, 8, 0), 2);
  EXPECT_EQ(GlobalIndex(nested(0, 1), 0, 8, 1), 5);
  DumpBuilder a(2, 2);  // "dp" here stands for the cp rank
  a.AddAll("x", x, DType::kFloat64, nested);
  a.AddAll("y", x, DType::kFloat64, [](int64_t tp_rank, int64_t cp_rank) {
    ShardSpec s;
    s.Split(ShardAxis::kCp, 0, 2, cp_rank).Split(ShardAxis::kTp, 2, 2, tp_rank, 2);
    return s;
  });
  a.Write(root_ / "a");
  DumpBuilder b(1, 1);
  b.Replicated("x", x, DType::kFloat64);
  b.Replicated("y", x, DType::kFloat64);
  b.Write(root_ / "b");
  const DiffResult r = Diff("a", "b");
  EXPECT_TRUE(Find(r, "x").pass) << Find(r, "x").problem;
  EXPECT_TRUE(Find(r, "y").pass) << Find(r, "y").problem;
  EXPECT_EQ(Find(r, "x").max_abs, 0.0);

  // The same pieces described with tp as the outer split land in other rows.
  DumpBuilder swapped(2, 2);
  swapped.AddAll("x", x, DType::kFloat64, nested);
  for (int64_t rank = 0; rank < 4; ++rank) {
    ShardSpec s;
    s.Split(ShardAxis::kTp, 0, 2, rank % 2).Split(ShardAxis::kCp, 0, 2, rank / 2);
    swapped.file(rank).metadata["x"] = SpecJson(x.shape(), s, false);
  }
  swapped.AddAll("y", x, DType::kFloat64, nested);
  swapped.Write(root_ / "swapped");
  const DiffResult w = Diff("swapped", "b");
  EXPECT_FALSE(Find(w, "x").pass);
}

// Context parallelism's load-balanced sequence split (cp rank r holds chunks r and
// 2 cp - 1 - r), with sequence parallelism's tp split inside each cp piece: the pieces
// reassemble into the full tensor; read as a plain contiguous cp split they do not.
TEST_F(DiffTest, LoadBalancedContextParallelSplitReassembles) {
  const Tensor x = Ramp({8, 2, 4});
  auto balanced = [](int64_t tp_rank, int64_t cp_rank) {
    ShardSpec s;
    s.SplitLoadBalanced(ShardAxis::kCp, 0, 2, cp_rank).Split(ShardAxis::kTp, 0, 2, tp_rank);
    return s;
  };
  // cp 0 holds rows 0 1 6 7: its tp 1 piece rows 6 7.
  EXPECT_EQ(GlobalIndex(balanced(1, 0), 0, 8, 0), 6);
  DumpBuilder a(2, 2);  // "dp" here stands for the cp rank
  a.AddAll("x", x, DType::kFloat64, balanced);
  a.Write(root_ / "a");
  DumpBuilder b(1, 1);
  b.Replicated("x", x, DType::kFloat64);
  b.Write(root_ / "b");
  const DiffResult r = Diff("a", "b");
  EXPECT_TRUE(Find(r, "x").pass) << Find(r, "x").problem;
  EXPECT_EQ(Find(r, "x").max_abs, 0.0);

  DumpBuilder plain(2, 2);
  plain.AddAll("x", x, DType::kFloat64, balanced);
  for (int64_t rank = 0; rank < 4; ++rank) {
    ShardSpec s;
    s.Split(ShardAxis::kCp, 0, 2, rank / 2).Split(ShardAxis::kTp, 0, 2, rank % 2);
    plain.file(rank).metadata["x"] = SpecJson(x.shape(), s, false);
  }
  plain.Write(root_ / "plain");
  EXPECT_FALSE(Find(Diff("plain", "b"), "x").pass);
}

// A zero-size dimension: nothing to compare, nothing to allocate, even when another
// dimension is huge (the index tables of a placement would be sized by it).
TEST_F(DiffTest, EmptyTensorsPass) {
  const Shape huge{0, int64_t{1} << 40};
  DumpBuilder a(2, 1);
  a.ModelSplit("empty", Tensor::HostZeros(huge, DType::kFloat64), DType::kFloat32, 1);
  a.Write(root_ / "a");
  DumpBuilder b(1, 1);
  b.Replicated("empty", Tensor::HostZeros(huge, DType::kFloat64), DType::kFloat64);
  b.Write(root_ / "b");
  const TensorDiff d = Find(Diff("a", "b"), "empty");
  EXPECT_TRUE(d.pass) << d.problem;
  EXPECT_EQ(d.elements, 0);
  EXPECT_EQ(d.worst_flat, -1);
  EXPECT_EQ(d.shape, huge);
}

TEST_F(DiffTest, TextReportHasTheTableAndSummary) {
  DumpBuilder a(1, 1);
  a.Replicated("w", Full({3}, [](int64_t e) { return e == 1 ? 2.5 : 1.0; }), DType::kFloat32);
  a.Replicated("v", Ramp({3}), DType::kFloat32);
  a.Write(root_ / "a");
  DumpBuilder b(1, 1);
  b.Replicated("w", Full({3}, [](int64_t) { return 1.0; }), DType::kFloat32);
  b.Replicated("v", Ramp({3}), DType::kFloat32);
  b.Write(root_ / "b");
  const std::string text = DiffText(Diff("a", "b"));
  ExpectContains(text, fmt::format("A: {} (cpu, 1 rank, tp 1, 2 tensors)\n", Path("a")));
  ExpectContains(text, "max abs err");
  ExpectContains(text, "FAIL (1 of 3 elements out of tolerance; worst [1]: 2.5 vs 1)");
  ExpectContains(text, "float32 atol 1e-05 rtol 0.0001");
  ExpectContains(text, "1 passed, 1 failed\n");
}

// ---- The configs: compared key by key before the tensors (core/dump/config_diff.h). ----

// Two effective configs of one small GPT (what `mpusim run` writes into a manifest).
Json GptConfigJson() {
  return Json::parse(R"({
    "description": "tiny",
    "parallel": {"world_size": 2, "tensor_model_parallel_size": 1,
                 "pipeline_model_parallel_size": 1, "context_parallel_size": 1, "bf16": false},
    "model": {"type": "gpt", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
              "vocab_size": 100, "init_method_std": 0.02},
    "run": {"seed": 1234, "dtype": "float32", "seq_length": 8, "micro_batch_size": 2,
            "num_microbatches": 1, "train_iters": 1, "recompute_granularity": null}})");
}

std::vector<std::pair<std::string, std::string>> Changes(const Json& a, const Json& b) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const ConfigDifference& d : CompareConfigs(FlattenConfig(a), FlattenConfig(b))) {
    out.emplace_back(d.key, ConfigChangeName(d.change));
  }
  return out;
}
using Changed = std::vector<std::pair<std::string, std::string>>;

TEST(ConfigDiff, EachKeyIsClassifiedByWhatItDoesToTheTensors) {
  const Json a = GptConfigJson();
  EXPECT_EQ(Changes(a, a), Changed{});
  Json b = a;
  b["description"] = "other words";  // free text: not compared
  b["run"]["seed"] = 99;
  b["run"]["train_iters"] = 3;
  b["run"]["dtype"] = "bfloat16";
  b["parallel"]["bf16"] = true;
  b["parallel"]["tensor_model_parallel_size"] = 2;
  b["model"]["init_method_std"] = 0.01;
  b["model"]["cp_comm_type"] = "a2a";  // set on one side only: how cp is done
  b["model"]["attention_backend"] = "flash";  // the same math on the executor
  b["optimizer"] = {{"lr", 0.1}};
  EXPECT_EQ(Changes(a, b), (Changed{{"model.attention_backend", "layout"},
                                    {"model.cp_comm_type", "layout"},
                                    {"model.init_method_std", "options"},
                                    {"optimizer.lr", "training"},
                                    {"parallel.bf16", "dtype"},
                                    {"parallel.tensor_model_parallel_size", "layout"},
                                    {"run.dtype", "dtype"},
                                    {"run.seed", "seed"},
                                    {"run.train_iters", "iterations"}}));
}

TEST(ConfigDiff, ModelShapeKeysMeanDifferentModelsOnlyWhenBothSetThem) {
  const Json a = GptConfigJson();
  Json b = a;
  b["model"]["hidden_size"] = 32;
  EXPECT_EQ(Changes(a, b), (Changed{{"model.hidden_size", "model"}}));
  // ffn_hidden_size defaults to 4 * hidden_size: 256 may be what A ran with.
  Json c = a;
  c["model"]["ffn_hidden_size"] = 256;
  EXPECT_EQ(Changes(a, c), (Changed{{"model.ffn_hidden_size", "options"}}));
  Json d = c;
  d["model"]["ffn_hidden_size"] = 128;
  EXPECT_EQ(Changes(c, d), (Changed{{"model.ffn_hidden_size", "model"}}));
  // A chain against a GPT, and chains of different lengths.
  const Json chain = {{"model", {{"layers", Json::array({{{"name", "fc1"}, {"p", 0.1}}})}}}};
  Json longer = chain;
  longer["model"]["layers"].push_back({{"name", "fc2"}});
  EXPECT_EQ(Changes(chain, longer), (Changed{{"model.layers[1].name", "model"}}));
  Json dropout = chain;
  dropout["model"]["layers"][0]["p"] = 0.2;
  EXPECT_EQ(Changes(chain, dropout), (Changed{{"model.layers[0].p", "options"}}));
  Json gpt = chain;
  gpt["model"]["type"] = "gpt";
  EXPECT_EQ(Changes(chain, gpt), (Changed{{"model.type", "model"}}));
}

// dp 2 with micro_batch_size 1 sees the samples dp 1 with micro_batch_size 2 does; a bigger
// micro-batch on the same layout does not.
TEST(ConfigDiff, BatchKeysAreLayoutWhenTheSamplesAgree) {
  const Json a = GptConfigJson();  // 2 ranks, dp 2, micro_batch_size 2: 4 per micro-batch
  Json b = a;
  b["parallel"]["world_size"] = 1;
  b["run"]["micro_batch_size"] = 4;
  EXPECT_EQ(Changes(a, b), (Changed{{"parallel.world_size", "layout"},
                                    {"run.micro_batch_size", "layout"}}));
  Json c = a;
  c["run"]["micro_batch_size"] = 4;
  EXPECT_EQ(Changes(a, c), (Changed{{"run.micro_batch_size", "data"}}));
  Json hostile = a;  // untrusted values never divide by zero or overflow
  hostile["parallel"]["tensor_model_parallel_size"] = Json(uint64_t{1} << 63);
  hostile["run"]["micro_batch_size"] = "4";
  EXPECT_EQ(Changes(a, hostile), (Changed{{"parallel.tensor_model_parallel_size", "layout"},
                                          {"run.micro_batch_size", "data"}}));
}

TEST_F(DiffTest, ConfigDifferencesComeFirstAndDifferentModelsAreRefused) {
  for (const char* name : {"a", "b", "c", "old"}) {
    DumpBuilder d = GoodDump();
    Json config = GptConfigJson();
    if (std::string(name) == "b") config["run"]["seed"] = 99;
    if (std::string(name) == "c") config["model"]["num_layers"] = 4;
    d.manifest()["config"] = config;
    if (std::string(name) != "old") d.manifest()["command_line"] = "mpusim run x.json";
    d.Write(root_ / name);
  }
  const DiffResult seed = Diff("a", "b");
  ASSERT_EQ(seed.config.size(), 1u);
  EXPECT_EQ(seed.config[0].key, "run.seed");
  const std::string text = DiffText(seed);
  const std::string head = fmt::format("A: {} (cpu, 2 ranks, tp 2, 2 tensors)\n"
                                       "B (expected): {} (cpu, 2 ranks, tp 2, 2 tensors)\n"
                                       "config: run.seed: 1234 vs 99 (seed)\n"
                                       "the runs differ in seed, expect differences\n",
                                       Path("a"), Path("b"));
  EXPECT_EQ(text.substr(0, head.size()), head);
  const Json json = Json::parse(DiffJson(seed));
  EXPECT_EQ(json["config"]["differences"][0],
            Json::parse(R"({"key": "run.seed", "a": 1234, "b": 99, "in_a": true, "in_b": true,
                            "change": "seed"})"));
  EXPECT_EQ(json["config"]["command_line_a"], "mpusim run x.json");
  ExpectContains(DiffText(Diff("a", "a")), "config: the same in both runs\n");
  ExpectContains(DiffText(Diff("old", "a")),
                 "config: A's dump predates recorded command lines: its config may miss their "
                 "overrides\n");

  const StatusOr<DiffResult> models = DiffDumps(Load("a"), Load("c"), {});
  ASSERT_FALSE(models.ok());
  EXPECT_EQ(models.status().Message(),
            "config: model.num_layers: 2 vs 4: the dumps hold different models (their tensors "
            "differ in name or shape); diff compares runs of one model");

  // Without a config on one side there is nothing to compare, and the report says so.
  DumpBuilder none = GoodDump();
  none.Write(root_ / "none");
  ExpectContains(DiffText(Diff("none", "a")), "config: not compared: A's manifest records none\n");
}

TEST_F(DiffTest, ConfigAndCommandLineFieldsAreChecked) {
  for (const auto& [key, value, message] :
       {std::tuple{"config", Json(3),
                   "config: must be an object (the run's config) or null, got 3"},
        std::tuple{"config", Json("x"), "config: must be an object"},
        std::tuple{"command_line", Json::array({"mpusim"}), "command_line: must be a string"},
        std::tuple{"config_file", Json(1), "config_file: must be a string, got 1"}}) {
    DumpBuilder b = GoodDump();
    b.manifest()[key] = value;
    ExpectContains(LoadError(b), message);
  }
}

}  // namespace
}  // namespace mpusim
