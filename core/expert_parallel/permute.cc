// The token permutation (see permute.h).
#include "core/expert_parallel/permute.h"

#include <algorithm>
#include <utility>

namespace mpusim {

Tensor IntsToDevice(Kernels& k, const std::vector<int64_t>& v, Shape shape) {
  Tensor host = Tensor::HostEmpty(std::move(shape), DType::kInt64);
  std::copy(v.begin(), v.end(), host.data_as<int64_t>());
  return k.ToDevice(host);
}

std::vector<int64_t> IntsToHost(Kernels& k, const Tensor& t) {
  const Tensor host = k.ToHost(t);
  const int64_t* p = host.data_as<int64_t>();
  return std::vector<int64_t>(p, p + host.numel());
}

Tensor Rows(const Tensor& m, int64_t r0, int64_t n) {
  return m.FlatSlice(r0 * m.cols(), n * m.cols()).Reshaped({n, m.cols()});
}

Tensor GatherRows(Kernels& k, const Tensor& src, const Tensor& ids) {
  Tensor out = k.Empty({ids.numel(), src.cols()}, src.dtype());
  if (ids.numel() > 0) k.EmbeddingForward(src, ids, 0, src.rows(), out);
  return out;
}

void ScatterAddRows(Kernels& k, const Tensor& rows, const Tensor& ids, Tensor& into) {
  if (ids.numel() > 0) k.EmbeddingBackward(rows, ids, 0, into.rows(), into);
}

}  // namespace mpusim
