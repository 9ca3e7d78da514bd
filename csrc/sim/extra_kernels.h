// Sim kernels beyond the fallback's "run the op's CPU kernel": the fused RNN cells (rnn.cpp),
// autocast (autocast.cpp), and the CPU kernels of ops whose composite kernel would run instead
// (composites.cpp). Called once by register_kernels().
#pragma once

#include <torch/library.h>

namespace torch_pipeline {
namespace sim {

// Registers the PrivateUse1 kernels of the fused LSTM/GRU cells and their backward ops on `aten`.
void register_rnn_kernels(torch::Library& aten);

// Registers AutocastPrivateUse1: CUDA's autocast op lists (torch.autocast("sim") casts what
// torch.autocast("cuda") casts) and a fallthrough for every other op.
void register_autocast();

// Registers the fallback as the PrivateUse1 kernel of every aten op that has both a CPU kernel and
// a CompositeExplicitAutograd one (native_layer_norm, native_group_norm, addr, ...): the dispatcher
// would pick the composite for a sim tensor, whose results differ from the CPU kernel's in
// rounding. Also makes scaled_dot_product_attention choose its kernel for sim as it does for the
// CPU.
void register_cpu_kernels_over_composites(torch::Library& aten);

}  // namespace sim
}  // namespace torch_pipeline
