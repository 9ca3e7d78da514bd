// Whether a CUDA stream is capturing into a graph, for the runtime's capture probe (capture.h;
// built only when torch has CUDA and a toolkit is found). cudaStreamGetCaptureInfo is allowed
// during a capture in every mode, never synchronizes and gives the capture's id, unique in the
// process.
#include "../runtime/capture_probe.h"

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

namespace torch_pipeline {
namespace cuda {
namespace {

core::CaptureId cuda_capture_of(const c10::Stream& stream) {
  const cudaStream_t s = c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream).stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  const cudaError_t err = cudaStreamGetCaptureInfo(s, &status, &id);
  if (err == cudaErrorStreamCaptureImplicit) {
    // The legacy default stream while a blocking stream captures: it is not capturing itself
    // (and the call does not invalidate the capture).
    (void)cudaGetLastError();
    return core::kNoCapture;
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // (not this probe's to report: the next CUDA call will)
    return core::kNoCapture;
  }
  switch (status) {
    case cudaStreamCaptureStatusActive:
      return id == 0 || id == core::kUnknownCapture ? core::kUnknownCapture
                                                    : static_cast<core::CaptureId>(id);
    case cudaStreamCaptureStatusInvalidated:
      return core::kUnknownCapture;
    default:
      return core::kNoCapture;
  }
}

[[maybe_unused]] const bool registered = register_capture_probe(c10::kCUDA, &cuda_capture_of);

}  // namespace
}  // namespace cuda
}  // namespace torch_pipeline
