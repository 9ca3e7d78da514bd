// CUDA streams owned by torch_pipeline (built only when torch has CUDA and a toolkit is found).
//
// torch's CUDA stream pool holds 32 streams per priority and device and hands the 33rd request the
// first stream again, so live pipelines drawn from it would silently alias. Here every pipeline
// slot gets a stream of its own, created with the CUDA runtime and wrapped for c10 with
// getStreamFromExternal. Slots keep their streams for the life of the process (lifetime-disjoint
// pipelines reuse them), so the streams are never destroyed.
#include "../runtime/streams.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <optional>

namespace torch_pipeline {
namespace cuda {
namespace {

c10::Stream create_exclusive_stream(c10::Device device, int priority) {
  c10::cuda::CUDAGuard guard(device.index());
  int least = 0;     // numerically largest: lowest priority
  int greatest = 0;  // numerically smallest: highest priority
  C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  const int clamped = std::clamp(priority, greatest, least);
  cudaStream_t stream = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, clamped));
  return c10::cuda::getStreamFromExternal(stream, device.index()).unwrap();
}

std::optional<PriorityRange> cuda_priority_range() {
  if (c10::cuda::device_count() == 0) {
    return std::nullopt;
  }
  PriorityRange range;
  C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&range.least, &range.greatest));
  range.source = "CUDA (cudaDeviceGetStreamPriorityRange)";
  return range;
}

[[maybe_unused]] const bool registered =
    register_exclusive_stream_factory(c10::kCUDA, &create_exclusive_stream);
[[maybe_unused]] const bool registered_range =
    register_priority_range(c10::kCUDA, &cuda_priority_range);

}  // namespace
}  // namespace cuda
}  // namespace torch_pipeline
