// The capture probes of the backends (see capture.h) and the process-wide query gate.
#include "capture_probe.h"

#include <array>
#include <atomic>

namespace torch_pipeline {
namespace {

// Constant-initialised, so a backend may register during static initialisation in any order.
std::array<std::atomic<CaptureProbe>,
           static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>
    g_probes{};

}  // namespace

bool register_capture_probe(c10::DeviceType type, CaptureProbe probe) {
  g_probes[static_cast<size_t>(type)].store(probe, std::memory_order_release);
  return true;
}

core::CaptureId capture_of(const c10::Stream& stream) {
  const CaptureProbe probe =
      g_probes[static_cast<size_t>(stream.device_type())].load(std::memory_order_acquire);
  return probe == nullptr ? core::kNoCapture : probe(stream);
}

core::QueryGate& query_gate() {
  static core::QueryGate* gate = new core::QueryGate();  // leaked: ops may run at exit
  return *gate;
}

}  // namespace torch_pipeline
