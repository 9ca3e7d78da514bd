// The boxed fallback of the sim device (fallback.cpp) and the kernels built on it, registered by
// register_kernels() (kernels.cpp).
#pragma once

#include <ATen/core/stack.h>

namespace c10 {
class OperatorHandle;
}  // namespace c10

namespace torch_pipeline {
namespace sim {

// Runs the op's CPU kernel on CPU aliases of its sim tensors, recording its accesses.
void sim_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// convolution_overrideable and its backward: aten::convolution / convolution_backward on the
// CPU aliases, recorded as the fallback records.
void convolution_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);
void convolution_backward_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace sim
}  // namespace torch_pipeline
