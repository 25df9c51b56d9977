// The token permutation of mixture-of-experts layers (Megatron's moe_utils permute and
// unpermute): rows of a 2-D tensor picked by int64 ids, and scatter-added back.
//
// What it is: the row moves a dispatcher (token_dispatcher.h) and the experts
// (core/model/moe) share, and the int64 id vectors between host and device that carry the
// routing decided on the host. What it is not: an exchange; nothing here communicates.
//
//   GatherRows      out[i, :] = src[ids[i], :]           (permute)
//   ScatterAddRows  into[ids[i], :] += rows[i, :]        (unpermute), in increasing i, so
//                                                         the sums are in a fixed order
#pragma once

#include <cstdint>
#include <vector>

#include "core/kernels.h"

namespace mpusim {

// An int64 tensor of `shape` on the device holding v, and back.
Tensor IntsToDevice(Kernels& k, const std::vector<int64_t>& v, Shape shape);
std::vector<int64_t> IntsToHost(Kernels& k, const Tensor& t);

// Rows [r0, r0 + n) of a 2-D tensor, as a view.
Tensor Rows(const Tensor& m, int64_t r0, int64_t n);

// out[i, :] = src[ids[i], :] (ids: int64 [n] into src's rows); [0, w] when n = 0.
Tensor GatherRows(Kernels& k, const Tensor& src, const Tensor& ids);

// into[ids[i], :] += rows[i, :], in increasing i.
void ScatterAddRows(Kernels& k, const Tensor& rows, const Tensor& ids, Tensor& into);

}  // namespace mpusim
