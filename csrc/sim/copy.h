// Kernels of the sim device that order streams with the host (copy.cpp), registered by
// register_kernels() (kernels.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/core/Stream.h>

namespace torch_pipeline {
namespace sim {

// copy_ between sim and cpu tensors or sim devices (aten::_copy_from): recorded on the current
// stream; a blocking copy with the host synchronizes it, a non_blocking one with pinned memory
// makes the host-side check watch the host bytes (host.h).
at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool non_blocking);
at::Tensor copy_from_and_resize(const at::Tensor& src, const at::Tensor& dst);
// .item(): a read of the tensor, and the host waits for the stream.
at::Scalar local_scalar_dense(const at::Tensor& self);
// Tensor.record_stream: the allocator's record_stream (allocator.h).
void record_stream_kernel(at::Tensor& self, c10::Stream stream);

}  // namespace sim
}  // namespace torch_pipeline
