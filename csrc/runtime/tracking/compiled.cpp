// CompiledRegion (see tracking.h): a call of compiled code as one op. Touches only the region's
// members and the observer's per-thread region switch; launches and ends like tp.track (scope.h).
#include "../context.h"
#include "observer.h"
#include "scope.h"
#include "state.h"

#include <algorithm>
#include <atomic>

namespace torch_pipeline {
namespace tracking {
namespace detail {
namespace {
std::atomic<bool> g_regions_wrapped{false};
std::atomic<bool> g_dynamo_loaded{false};
}  // namespace

bool regions_wrapped() { return g_regions_wrapped.load(std::memory_order_relaxed); }

bool range_check_due() {
  return g_dynamo_loaded.load(std::memory_order_relaxed) && !regions_wrapped();
}
}  // namespace detail

void set_regions_wrapped(bool wrapped) {
  detail::g_regions_wrapped.store(wrapped);
  detail::compiled_state_changed();
}

void set_dynamo_loaded() {
  detail::g_dynamo_loaded.store(true);
  detail::compiled_state_changed();
}

CompiledRegion::CompiledRegion(const std::vector<at::Tensor>& args) {
  using namespace detail;
  if (!live() || !begin_region()) {
    return;
  }
  open_ = true;
  count(&Counters::compiled_regions);
  try {
    for (const at::Tensor& t : args) {
      if (has_data(t)) {
        args_.push_back(t);
      }
    }
    // Every argument is read and written (a write orders after earlier reads and writes).
    std::vector<Access> accesses;
    accesses.reserve(args_.size());
    for (const at::Tensor& t : args_) {
      accesses.push_back(Access{&t, true});
      if (!t.device().is_cpu() && in_pipeline()) {
        enter_device(t.device());
      }
    }
    open_scope(accesses, launched_, period_, keep_alive_);
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

CompiledRegion::~CompiledRegion() { close(); }

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
  close_scope(launched_, period_, keep_alive_, &fresh_, "a compiled region");
  fresh_.clear();
  args_.clear();
}

}  // namespace tracking
}  // namespace torch_pipeline
