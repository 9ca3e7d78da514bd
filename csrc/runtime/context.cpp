#include "context.h"

#include "devices.h"
#include "runtime.h"
#include "tracking.h"
#include "warn.h"

#include <ATen/record_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace {

struct Entry {
  PipelinePtr pipeline;            // what this entry made current
  PipelinePtr previous;            // what was current before it
  std::vector<c10::Stream> saved;  // the torch current streams it replaced, one per device
  // A named range for profilers (torch.profiler, Kineto): "tp.pipeline worker W slot S", open
  // from entry to exit. Made only while some RecordFunction callback wants user scopes.
  std::unique_ptr<at::RecordFunction> range;
};

std::unique_ptr<at::RecordFunction> open_range(const PipelineImpl& p) {
  if (!at::hasCallbacks()) {
    return nullptr;
  }
  auto range = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (!range->isActive()) {
    return nullptr;
  }
  range->before("tp.pipeline worker " + std::to_string(p.worker_id()) + " slot " +
                std::to_string(p.id()));
  return range;
}

struct ThreadState {
  PipelinePtr current;  // nullptr: the default pipeline
  std::vector<Entry> stack;
  // Streams that set_pipeline() replaced while no context was open: the default pipeline's
  // streams on those devices (there is no entry to remember them).
  std::vector<c10::Stream> base;
};

thread_local ThreadState tls;

c10::Stream exchange(const c10::Stream& s) {
  return c10::impl::getDeviceGuardImpl(s.device_type())->exchangeStream(s);
}

bool has_device(const std::vector<c10::Stream>& streams, const c10::Device& d) {
  return std::any_of(streams.begin(), streams.end(),
                     [&](const c10::Stream& s) { return s.device() == d; });
}

// The stream that was current on `device` before the outermost open entry switched it.
c10::Stream base_stream(const c10::Device& device) {
  for (const c10::Stream& s : tls.base) {
    if (s.device() == device) {
      return s;
    }
  }
  for (const Entry& e : tls.stack) {
    for (const c10::Stream& s : e.saved) {
      if (s.device() == device) {
        return s;
      }
    }
  }
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

// Where a stream replaced outside any entry's own switch is remembered so that it is restored:
// in the innermost open context (whose exit restores it), or, outside any context, as the
// default pipeline's streams.
std::vector<c10::Stream>& restore_list() {
  return tls.stack.empty() ? tls.base : tls.stack.back().saved;
}

// Switches the current streams to `lane`; returns what it replaced. All or nothing.
std::vector<c10::Stream> switch_streams(const DeviceStreams& lane) {
  std::vector<c10::Stream> saved;
  saved.reserve(lane.size());
  try {
    for (const auto& ds : lane) {
      saved.push_back(exchange(ds.second));
    }
  } catch (...) {
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      exchange(*it);
    }
    throw;
  }
  return saved;
}

}  // namespace

PipelinePtr current_pipeline() {
  const PipelinePtr& cur = tls.current;
  if (cur && !cur->is_default()) {
    return cur;
  }
  return Runtime::get().default_pipeline();
}

DeviceStreams lane_streams(PipelineImpl& p) {
  p.check_usable();
  const auto acc = accelerator();
  if (!p.is_default()) {
    if (acc.has_value()) {
      p.own_stream(current_device(*acc));  // make sure the current device is part of the lane
    }
    return p.own_streams();
  }
  DeviceStreams lane;
  auto add = [&](const c10::Device& d) {
    const bool present =
        std::any_of(lane.begin(), lane.end(), [&](const auto& ds) { return ds.first == d; });
    if (!present) {
      lane.emplace_back(d, base_stream(d));
    }
  };
  if (acc.has_value()) {
    add(current_device(*acc));
  }
  for (const c10::Stream& s : tls.base) {
    add(s.device());
  }
  for (const Entry& e : tls.stack) {
    for (const c10::Stream& s : e.saved) {
      add(s.device());
    }
  }
  return lane;
}

bool in_pipeline() {
  const PipelinePtr& cur = tls.current;
  return cur != nullptr && !cur->is_default();
}

void enter_device(const c10::Device& device) {
  const PipelinePtr& cur = tls.current;
  if (cur == nullptr || cur->is_default() || device.is_cpu()) {
    return;
  }
  auto& saved = restore_list();
  if (has_device(saved, device)) {
    return;  // switched already
  }
  const c10::Stream mine = cur->own_stream(device);  // acquired on first use
  const c10::Stream replaced = exchange(mine);
  saved.push_back(replaced);
}

c10::Stream pipeline_stream(PipelineImpl& p, const c10::Device& device) {
  const c10::Device d = check_stream_device(device);
  p.check_usable();
  if (p.is_default()) {
    return base_stream(d);
  }
  return p.own_stream(d);
}

void enter_pipeline(const PipelinePtr& p) {
  TORCH_INTERNAL_ASSERT(p != nullptr);
  tracking::observe_this_thread();  // (a worker thread, or one tracking went live without)
  Entry entry{p, tls.current, switch_streams(lane_streams(*p)), open_range(*p)};
  tls.stack.push_back(std::move(entry));
  tls.current = p;
}

void exit_pipeline(const PipelineImpl* p) {
  TORCH_CHECK(
      !tls.stack.empty(),
      "exiting a pipeline context that is not open on this thread (contexts are per thread: "
      "enter and exit each one on the same thread)");
  Entry& top = tls.stack.back();
  TORCH_CHECK(
      top.pipeline.get() == p,
      "pipeline contexts must be exited in the reverse order of entering them: the innermost "
      "open context on this thread is of pipeline ",
      top.pipeline->id(), " (worker thread ", top.pipeline->worker_id(),
      "), not of the one being exited");
  for (auto it = top.saved.rbegin(); it != top.saved.rend(); ++it) {
    exchange(*it);
  }
  Entry done = std::move(top);
  tls.stack.pop_back();
  tls.current = std::move(done.previous);
  // `done` goes here, after the thread state is consistent: it may hold the last reference to
  // its pipeline, whose slot is then released.
}

void set_pipeline(const PipelinePtr& p) {
  TORCH_INTERNAL_ASSERT(p != nullptr);
  tracking::observe_this_thread();
  const DeviceStreams lane = lane_streams(*p);
  std::vector<c10::Stream> replaced = switch_streams(lane);
  auto& saved = restore_list();
  for (const c10::Stream& s : replaced) {
    if (!has_device(saved, s.device())) {
      saved.push_back(s);
    }
  }
  if (tls.stack.empty() && p->is_default()) {
    tls.base.clear();  // the default streams are current again
  }
  tls.current = p;
}

PipelineGuard::PipelineGuard(PipelinePtr p) : pipeline_(std::move(p)) { enter_pipeline(pipeline_); }

PipelineGuard::~PipelineGuard() {
  try {
    exit_pipeline(pipeline_.get());
  } catch (const std::exception& e) {
    warn(std::string("internal error while leaving a pipeline: ") + e.what());
  }
}

}  // namespace torch_pipeline
