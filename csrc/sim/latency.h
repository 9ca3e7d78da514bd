// The sim device's latency model (docs/design.md, "Asynchronous mode and the latency model"): how
// long a kernel takes on the device.
//
// A kernel that touches `bytes` of device memory takes launch_us + bytes / bandwidth, or the
// time set for its op by name (for tests). Defaults: 0 and no bandwidth term, so nothing waits.
// In asynchronous mode a stream's thread sleeps for that time before the kernel's work, whose
// results so land at its end; in synchronous mode the calling thread sleeps after the work.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>

namespace torch_pipeline {
namespace sim {

struct LatencyModel {
  double launch_us = 0.0;       // per kernel
  double bandwidth_gbps = 0.0;  // GB/s of device memory; 0: no bandwidth term
};

// Sets what is given (ValueError for a negative or non-finite value).
void set_latency(std::optional<double> launch_us, std::optional<double> bandwidth_gbps);
LatencyModel latency();
// The time of every kernel of `op` (a full name such as "aten::mul.Tensor"), whatever its bytes;
// a negative `us` removes the override. clear_op_latencies() removes them all.
void set_op_latency(const std::string& op, double us);
void clear_op_latencies();

// The modelled device time of a kernel of `op` touching `bytes`.
std::chrono::nanoseconds modelled_time(const std::string& op, size_t bytes);

}  // namespace sim
}  // namespace torch_pipeline
