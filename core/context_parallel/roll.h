// Multi-token prediction's roll of the token ids, labels and loss mask across the cp ranks
// (Megatron-Core's multi_token_prediction.roll_tensor, shifts = -1).
//
// What it is: each rank's [s_cp, b] rows (sequence_order.h: its chunks r and 2 cp - 1 - r of
// 2 cp, in that order) moved one position earlier in the sequence, as torch.roll on the
// whole [b, s] tensor would with the vacated last position set to 0. Each chunk rolls
// locally; its last position then takes the first position of the chunk after it in the
// sequence, which another rank holds:
//
//   chunk r's successor r + 1 is rank r + 1's first chunk (the last rank: its own second);
//   chunk 2 cp - 1 - r's successor is rank r - 1's second chunk (rank 0: none, so 0).
//
// So rank r sends the first position of its first chunk to r - 1 and of its second chunk to
// r + 1, and receives the two it needs back, b elements each, in one batch (roll_tensor's
// isend/irecv pairs). What it is not: the roll of packed sequences (not built).
#pragma once

#include <cstdint>

#include "core/communicator.h"
#include "core/kernels.h"

namespace mpusim {

// `x`: this rank's [s_cp, b] rows (any dtype, on the backend's device), cp rank `me` of `cp`
// over `group` (unused when cp is 1), messages tagged `tag`. Returns the rolled rows.
Tensor RollLeftAcrossCp(Kernels& k, Communicator* group, int64_t cp, int64_t me, const Tensor& x,
                        int tag);

}  // namespace mpusim
