// The device side of a task submitted to a pipeline (docs/design.md,
// "The Python API and the rules users rely on" and "The rules"):
// - the submitter's position: events on the submitter's current streams, which the task's streams
//   wait for before the task runs;
// - the task's end: events on the task's streams, which a waiter's current streams wait for;
// - a completion latch the submitter can wait on.
// Each wait is reported to the tracker (tracking::waited), so it inserts no wait already implied.
#pragma once

#include "pipeline.h"
#include "tracking.h"

#include <c10/core/Event.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

namespace torch_pipeline {

class TaskSync {
 public:
  // `worker_id`: the worker thread the task is queued on.
  explicit TaskSync(int worker_id);

  // On the submitting thread: records events on the current streams of every accelerator device
  // that may have pending work in this process.
  void record_submitter_position();
  // On the worker thread, inside the task's pipeline context: the task's streams wait for the
  // submitter's position.
  void wait_for_submitter(PipelineImpl& p);
  // On the worker thread, inside the pipeline context, after the task body: records the end of
  // the task's work on its streams.
  void record_end(PipelineImpl& p);
  // Marks the task done (after record_end, or without device work if it never ran).
  void mark_done();
  // The runtime generation the task was submitted in (see Runtime::current_generation).
  uint64_t generation() const { return generation_; }
  int worker_id() const { return worker_id_; }
  // The task's number on its worker thread (WorkerThread::submit), 0 until set after the submit.
  void set_seq(uint64_t seq) { seq_.store(seq, std::memory_order_release); }
  uint64_t seq() const { return seq_.load(std::memory_order_acquire); }

  bool done() const;
  // Waits until done or timeout; returns done(). Tasks are often short: it first polls for up to
  // kSpin (a few microseconds, well under a thread wake-up) before it sleeps.
  bool wait_for(std::chrono::milliseconds timeout) const;
  static constexpr std::chrono::microseconds kSpin{20};
  // After done(): the calling thread's current streams wait for the task's end.
  void block_current_streams() const;

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  std::atomic<bool> done_{false};
  const uint64_t generation_;
  const int worker_id_;
  std::atomic<uint64_t> seq_{0};
  struct Recorded {
    c10::Device device;
    c10::Event event;
    tracking::Mark mark;  // the tracker's mark of the recorded stream
  };
  std::vector<Recorded> start_;
  std::vector<Recorded> end_;
};

}  // namespace torch_pipeline
