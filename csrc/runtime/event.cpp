#include "event.h"

#include "context.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace torch_pipeline {

PipelineEvent::PipelineEvent(bool enable_timing) : enable_timing_(enable_timing) {}

void PipelineEvent::record(PipelineImpl& p) {
  const DeviceStreams lane = lane_streams(p);
  std::vector<std::pair<c10::Device, c10::Event>> fresh;
  std::vector<tracking::Mark> marks;
  fresh.reserve(lane.size());
  marks.reserve(lane.size());
  for (const auto& [device, stream] : lane) {
    marks.push_back(tracking::mark(stream));  // (before the record: the event covers the mark)
    fresh.emplace_back(device,
                       c10::Event(device.type(), enable_timing_ ? c10::EventFlag::BACKEND_DEFAULT
                                                                : c10::EventFlag::PYTORCH_DEFAULT));
    fresh.back().second.record(stream);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  events_ = std::move(fresh);
  marks_ = std::move(marks);
}

void PipelineEvent::wait(PipelineImpl& p) const {
  std::vector<c10::Device> devices = this->devices();
  for (const c10::Device& d : devices) {
    const c10::Stream s = pipeline_stream(p, d);
    std::vector<tracking::Mark> waited;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = 0; i < events_.size(); ++i) {
        if (events_[i].first == d) {
          events_[i].second.block(s);
          waited.push_back(marks_[i]);
        }
      }
    }
    for (const tracking::Mark& m : waited) {
      tracking::waited(s, m);  // (after the event's lock: the tracker takes its own)
    }
  }
}

bool PipelineEvent::query() const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& de : events_) {
    if (!de.second.query()) {
      return false;
    }
  }
  return true;
}

void PipelineEvent::synchronize() const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& de : events_) {
    de.second.synchronize();
  }
}

double PipelineEvent::elapsed_time(const PipelineEvent& end, const c10::Device& device) const {
  TORCH_CHECK_VALUE(enable_timing_ && end.enable_timing_,
                    "elapsed_time needs both events created with enable_timing=True");
  if (&end == this) {
    const std::vector<c10::Device> recorded = devices();
    TORCH_CHECK_VALUE(std::find(recorded.begin(), recorded.end(), device) != recorded.end(),
                      "elapsed_time: the event was not recorded on ", device);
    return 0.0;
  }
  std::scoped_lock lock(mutex_, end.mutex_);
  const c10::Event* a = nullptr;
  const c10::Event* b = nullptr;
  for (const auto& de : events_) {
    if (de.first == device) a = &de.second;
  }
  for (const auto& de : end.events_) {
    if (de.first == device) b = &de.second;
  }
  TORCH_CHECK_VALUE(a != nullptr && b != nullptr,
                    "elapsed_time: both events must have been recorded on ", device);
  return a->elapsedTime(*b);
}

std::vector<c10::Device> PipelineEvent::devices() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<c10::Device> out;
  out.reserve(events_.size());
  for (const auto& de : events_) {
    out.push_back(de.first);
  }
  return out;
}

}  // namespace torch_pipeline
