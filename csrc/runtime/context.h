// The thread-local current pipeline (docs/design.md, "The Python API and the rules users rely on":
// thread-local, nests, restored on exit even when the body raises) and the torch current streams
// that follow it.
#pragma once

#include "pipeline.h"

namespace torch_pipeline {

// The calling thread's current pipeline (the default pipeline outside any context).
PipelinePtr current_pipeline();

// Makes `p` current and its streams the current torch streams of the devices it works on. Each
// entry saves what it replaced, so entries nest and one pipeline can be entered many times.
void enter_pipeline(const PipelinePtr& p);
// Undoes the innermost entry, which must be of `p` (RuntimeError otherwise).
void exit_pipeline(const PipelineImpl* p);
// Makes `p` current without an entry to undo (like torch.cuda.set_stream); inside a context, the
// context's exit restores what was current before it.
void set_pipeline(const PipelinePtr& p);

// Whether a non-default pipeline is current on this thread (one thread-local read).
bool in_pipeline();

// Before an op runs on accelerator `device` (automatic synchronization calls it): if a
// non-default pipeline is current and its context has not switched `device` yet, acquires the
// pipeline's stream there and makes it the current stream for the rest of the context; the
// context's exit restores the stream it replaced (also when the body raises). So a pipeline is a
// lane over every device it touches, not only those it had streams on when it was entered.
void enter_device(const c10::Device& device);

// The streams of `p` on the devices it works on, as seen from this thread: for a pipeline, its
// own streams plus its stream on the current accelerator device (acquired on first use); for the
// default pipeline, the streams that were current before this thread entered its outermost
// pipeline context, on the current accelerator device and every device a context switched.
DeviceStreams lane_streams(PipelineImpl& p);

// The stream of `p` on `device` (checked: an existing accelerator device).
c10::Stream pipeline_stream(PipelineImpl& p, const c10::Device& device);

// RAII: enter_pipeline in the constructor, exit_pipeline in the destructor.
class PipelineGuard {
 public:
  explicit PipelineGuard(PipelinePtr p);
  ~PipelineGuard();
  PipelineGuard(const PipelineGuard&) = delete;
  PipelineGuard& operator=(const PipelineGuard&) = delete;

 private:
  PipelinePtr pipeline_;
};

}  // namespace torch_pipeline
