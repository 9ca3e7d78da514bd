// PipelineEvent: a cross-device event. Recording it on a pipeline records one c10::Event on each
// of the pipeline's streams; waiting on it makes a pipeline's stream on each of those devices
// wait for the event of that device. The tracker is told of each wait (tracking::waited), so it
// inserts no wait the event already implies.
#pragma once

#include "pipeline.h"
#include "tracking.h"

#include <c10/core/Event.h>

#include <mutex>
#include <vector>

namespace torch_pipeline {

class PipelineEvent {
 public:
  explicit PipelineEvent(bool enable_timing);

  // Records on the streams of `p` (see lane_streams), replacing any earlier recording.
  void record(PipelineImpl& p);
  // Makes `p`'s stream on each recorded device wait for this event. No-op if never recorded.
  void wait(PipelineImpl& p) const;
  // Whether all recorded work is complete (true if never recorded).
  bool query() const;
  // Blocks the calling thread until the recorded work is complete.
  void synchronize() const;
  // Milliseconds between this event and `end` on `device` (both recorded with timing on it).
  double elapsed_time(const PipelineEvent& end, const c10::Device& device) const;

  bool enable_timing() const { return enable_timing_; }
  std::vector<c10::Device> devices() const;

 private:
  const bool enable_timing_;
  mutable std::mutex mutex_;
  std::vector<std::pair<c10::Device, c10::Event>> events_;
  std::vector<tracking::Mark> marks_;  // the tracker's mark of each event's stream, by index
};

}  // namespace torch_pipeline
