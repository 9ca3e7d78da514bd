#include "task.h"

#include "context.h"
#include "devices.h"
#include "runtime.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <thread>

namespace torch_pipeline {

TaskSync::TaskSync(int worker_id)
    : generation_(Runtime::current_generation()), worker_id_(worker_id) {}

void TaskSync::record_submitter_position() {
  for (const c10::Device& d : initialized_accelerator_devices()) {
    const c10::Stream s = c10::impl::getDeviceGuardImpl(d.type())->getStream(d);
    const tracking::Mark mark = tracking::mark(s);  // (before the record: the event covers it)
    start_.push_back(Recorded{d, c10::Event(d.type()), mark});
    start_.back().event.record(s);
  }
}

void TaskSync::wait_for_submitter(PipelineImpl& p) {
  // start_ is written before the task is queued and read only here, after it is dequeued.
  for (const Recorded& r : start_) {
    const c10::Stream s = pipeline_stream(p, r.device);
    r.event.block(s);
    tracking::waited(s, r.mark);
  }
}

void TaskSync::record_end(PipelineImpl& p) {
  DeviceStreams lane = lane_streams(p);
  // Every device that may hold work of the task: those initialised when it was submitted (the
  // devices of start_; initialisation is never undone) and those it initialised itself.
  for (const c10::Device& d : initialized_accelerator_devices()) {
    const bool present =
        std::any_of(lane.begin(), lane.end(), [&](const auto& ds) { return ds.first == d; });
    if (!present) {
      lane.emplace_back(d, pipeline_stream(p, d));
    }
  }
  std::vector<Recorded> end;
  end.reserve(lane.size());
  for (const auto& [device, stream] : lane) {
    const tracking::Mark mark = tracking::mark(stream);
    end.push_back(Recorded{device, c10::Event(device.type()), mark});
    end.back().event.record(stream);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  end_ = std::move(end);
}

void TaskSync::mark_done() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

bool TaskSync::done() const { return done_.load(std::memory_order_acquire); }

bool TaskSync::wait_for(std::chrono::milliseconds timeout) const {
  const auto spin_until = std::chrono::steady_clock::now() + kSpin;
  while (std::chrono::steady_clock::now() < spin_until) {
    if (done()) {
      return true;
    }
    std::this_thread::yield();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  return cv_.wait_for(lock, timeout, [&] { return done(); });
}

void TaskSync::block_current_streams() const {
  std::vector<std::pair<c10::Stream, tracking::Mark>> waited;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Recorded& r : end_) {
      const c10::Stream s = c10::impl::getDeviceGuardImpl(r.device.type())->getStream(r.device);
      r.event.block(s);
      waited.emplace_back(s, r.mark);
    }
  }
  for (const auto& [s, mark] : waited) {
    tracking::waited(s, mark);  // (after the lock: the tracker takes its own)
  }
}

}  // namespace torch_pipeline
