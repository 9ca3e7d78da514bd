// Graph capture, as the backends report it (docs/design.md, "Graph capture"): a backend that
// can capture streams into graphs (CUDA, in csrc/cuda; the sim device's twin, in csrc/sim)
// registers a probe that says whether a stream is capturing and into which capture. The runtime
// and the tracker ask only through here, so the CPU build links without CUDA.
#pragma once

#include "../core/capture_state.h"

#include <c10/core/Stream.h>

namespace torch_pipeline {

// The capture `stream` is capturing into: core::kNoCapture if none, core::kUnknownCapture if it
// is capturing but the backend cannot say which capture (an invalidated one). Must not
// synchronize, query work or fail a capture (cudaStreamGetCaptureInfo is allowed during one).
using CaptureProbe = core::CaptureId (*)(const c10::Stream& stream);

// Registers the probe of device type `type` (at static-initialisation time or when the backend is
// enabled). Returns true so it can initialise a static.
bool register_capture_probe(c10::DeviceType type, CaptureProbe probe);

// What the probe of the stream's device type says; core::kNoCapture without one.
core::CaptureId capture_of(const c10::Stream& stream);

// Whether device queries and synchronizations are allowed now: no capture the runtime knows of
// is underway in the process, or about to begin (CUDA's global capture mode forbids them in every
// thread during one). The tracker makes its queries under the gate's permits, so its polls and
// host waits pause while it is paused, and a capture's begin waits for the ones running.
core::QueryGate& query_gate();

}  // namespace torch_pipeline
