#include "pipeline.h"

#include "runtime.h"
#include "streams.h"
#include "tracking.h"
#include "warn.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace torch_pipeline {

DeviceStreams SlotTable::streams_of(int64_t slot) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = streams_.find(slot);
  return it == streams_.end() ? DeviceStreams{} : it->second;
}

std::map<int64_t, DeviceStreams> SlotTable::all_streams() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return streams_;
}

c10::Stream SlotTable::stream(int64_t slot, const c10::Device& device) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& list = streams_[slot];
  for (const auto& [d, s] : list) {
    if (d == device) {
      return s;
    }
  }
  c10::Stream s = new_stream(device, priority_);
  list.emplace_back(device, s);
  return s;
}

PipelineImpl::PipelineImpl(SlotTable* table, int64_t slot, int worker_id, int priority,
                           uint64_t generation)
    : table_(table),
      slot_(slot),
      worker_id_(worker_id),
      priority_(priority),
      generation_(generation) {
  if (table_ != nullptr) {
    streams_ = table_->streams_of(slot_);
    auto& rt = Runtime::get();
    for (const auto& ds : streams_) {
      rt.note_live_stream(ds.second);
    }
    tracking::pipeline_created();
  }
}

PipelineImpl::~PipelineImpl() {
  if (table_ == nullptr || generation_ != Runtime::current_generation()) {
    return;  // default pipeline, or a pipeline of the parent process after fork(): leave it be
  }
  auto& rt = Runtime::get();
  for (const auto& ds : streams_) {
    rt.note_dead_stream(ds.second);
  }
  table_->release(slot_);
  try {
    tracking::pipeline_destroyed();
  } catch (const std::exception& e) {
    warn(std::string("could not stop automatic synchronization: ") + e.what());
  }
}

void PipelineImpl::check_usable() const {
  TORCH_CHECK(
      generation_ == Runtime::current_generation(),
      "this Pipeline was created before os.fork(), in the parent process; its worker thread and "
      "streams do not exist in the child: create a new Pipeline in the child");
}

c10::Stream PipelineImpl::own_stream(const c10::Device& device) {
  TORCH_INTERNAL_ASSERT(table_ != nullptr, "the default pipeline has no streams of its own");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [d, s] : streams_) {
      if (d == device) {
        return s;
      }
    }
  }
  check_usable();
  c10::Stream s = table_->stream(slot_, device);
  bool added = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool present = std::any_of(streams_.begin(), streams_.end(),
                                     [&](const auto& ds) { return ds.first == device; });
    if (!present) {
      streams_.emplace_back(device, s);
      added = true;
    }
  }
  if (added) {
    Runtime::get().note_live_stream(s);
  }
  return s;
}

DeviceStreams PipelineImpl::own_streams() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return streams_;
}

void PipelineImpl::note_task(uint64_t seq) {
  uint64_t prev = last_task_.load(std::memory_order_relaxed);
  while (prev < seq && !last_task_.compare_exchange_weak(prev, seq, std::memory_order_acq_rel)) {
  }
}

}  // namespace torch_pipeline
