#include "latency.h"

#include "fork.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cmath>
#include <map>
#include <mutex>

namespace torch_pipeline {
namespace sim {
namespace {

std::mutex g_mutex;  // a leaf: no other sim lock is taken while it is held
LatencyModel g_model;
std::map<std::string, double>* g_ops = new std::map<std::string, double>();
// Fast path: no model and no override set, every kernel takes 0.
std::atomic<bool> g_any{false};

void check(double v, const char* what) {
  TORCH_CHECK_VALUE(std::isfinite(v) && v >= 0.0, "sim.set_latency: ", what,
                    " must be a finite number >= 0, got ", v);
}

void update_any_locked() {
  g_any.store(g_model.launch_us > 0.0 || g_model.bandwidth_gbps > 0.0 || !g_ops->empty());
}

}  // namespace

void set_latency(std::optional<double> launch_us, std::optional<double> bandwidth_gbps) {
  if (launch_us.has_value()) check(*launch_us, "launch_us");
  if (bandwidth_gbps.has_value()) check(*bandwidth_gbps, "bandwidth_gbps");
  std::lock_guard<std::mutex> lock(g_mutex);
  if (launch_us.has_value()) g_model.launch_us = *launch_us;
  if (bandwidth_gbps.has_value()) g_model.bandwidth_gbps = *bandwidth_gbps;
  update_any_locked();
}

LatencyModel latency() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_model;
}

void set_op_latency(const std::string& op, double us) {
  TORCH_CHECK_VALUE(std::isfinite(us), "sim.set_latency: us must be finite, got ", us);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (us < 0.0) {
    g_ops->erase(op);
  } else {
    (*g_ops)[op] = us;
  }
  update_any_locked();
}

void clear_op_latencies() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_ops->clear();
  update_any_locked();
}

std::chrono::nanoseconds modelled_time(const std::string& op, size_t bytes) {
  if (!g_any.load(std::memory_order_relaxed)) {
    return std::chrono::nanoseconds(0);
  }
  double us = 0.0;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_ops->find(op);
    if (it != g_ops->end()) {
      us = it->second;
    } else {
      us = g_model.launch_us;
      if (g_model.bandwidth_gbps > 0.0) {
        us += static_cast<double>(bytes) / (g_model.bandwidth_gbps * 1e3);  // bytes / (GB/s) in us
      }
    }
  }
  return std::chrono::nanoseconds(static_cast<int64_t>(us * 1e3));
}

void lock_latency_for_fork() { g_mutex.lock(); }

void unlock_latency_after_fork() { g_mutex.unlock(); }

}  // namespace sim
}  // namespace torch_pipeline
