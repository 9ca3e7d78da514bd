// CompiledRegion (see tracking.h): a call of compiled code as one op. Touches only the region's
// members and the observer's per-thread region switch; acts through the pins, host-watch and launch
// rooms, like TrackScope.
#include "../context.h"
#include "../warn.h"
#include "host_watch.h"
#include "launch.h"
#include "observer.h"
#include "pins.h"
#include "state.h"

#include <algorithm>
#include <atomic>

namespace torch_pipeline {
namespace tracking {
namespace detail {
namespace {
std::atomic<bool> g_regions_wrapped{false};
}  // namespace

bool regions_wrapped() {
  return g_regions_wrapped.load(std::memory_order_relaxed);
}
}  // namespace detail

void set_regions_wrapped(bool wrapped) {
  detail::g_regions_wrapped.store(wrapped);
}

CompiledRegion::CompiledRegion(const std::vector<at::Tensor>& args) {
  using namespace detail;
  if (!live() || !begin_region()) {
    return;
  }
  open_ = true;
  count(g_counters.compiled_regions);
  try {
    for (const at::Tensor& t : args) {
      if (has_data(t)) {
        args_.push_back(t);
      }
    }
    // Every argument is read and written (a write orders after earlier reads and writes).
    std::vector<Access> accesses;
    accesses.reserve(args_.size());
    bool on_device = false;
    for (const at::Tensor& t : args_) {
      accesses.push_back(Access{&t, true});
      if (!t.device().is_cpu()) {
        on_device = true;
        if (in_pipeline()) {
          enter_device(t.device());
        }
      }
    }
    wait_for_pins(accesses);
    ThreadRun& run = thread_run();
    if (watching_host() || g_pins.load() > 0) {
      std::vector<Access> cpu;
      for (const Access& a : accesses) {
        if (a.tensor->device().is_cpu()) {
          cpu.push_back(a);
        }
      }
      if (!cpu.empty()) {
        host_access(cpu, run.reads, run.writes);
      }
    }
    if (on_device) {
      device_launch(run, accesses, /*async=*/false, launched_, period_);
      keep_alive_ = std::move(run.keep_alive);  // the region's own, like TrackScope's
      run.keep_alive.clear();
    }
  } catch (...) {
    if (!launched_.empty()) {
      settle(launched_, period_);
      launched_.clear();
    }
    end_region();
    open_ = false;
    throw;
  }
}

void CompiledRegion::outputs(const std::vector<at::Tensor>& outs) {
  using namespace detail;
  if (!open_) {
    return;
  }
  for (const at::Tensor& x : outs) {
    if (!has_data(x) || x.device().is_cpu()) {
      continue;
    }
    const bool is_arg = std::any_of(args_.begin(), args_.end(), [&](const at::Tensor& a) {
      return a.storage().unsafeGetStorageImpl() == x.storage().unsafeGetStorageImpl();
    });
    if (!is_arg) {
      fresh_.push_back(x);  // made by the region on its stream
    }
  }
}

CompiledRegion::~CompiledRegion() {
  close();
}

void CompiledRegion::close() {
  using namespace detail;
  if (!open_) {
    return;
  }
  open_ = false;
  end_region();
  if (launched_.empty()) {
    return;
  }
  ThreadRun& run = thread_run();
  run.keep_alive = std::move(keep_alive_);
  try {
    finish(run, launched_, period_, &fresh_, false);
    launched_.clear();
    fresh_.clear();
    args_.clear();
  } catch (const std::exception& e) {
    warn_once("tracking failed at the end of a compiled region",
              std::string("automatic synchronization failed at the end of a compiled region (") +
                  e.what() + "); it may race.");
  }
}

}  // namespace tracking
}  // namespace torch_pipeline
