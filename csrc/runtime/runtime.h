// Process-wide runtime state: the worker-thread cap, the worker pool, the slot tables, the default
// pipeline. State is per "generation": a fork() starts a new one in the child (the parent's
// threads do not exist there, and its locks may be held), leaking the old one untouched.
#pragma once

#include "../core/worker_pool.h"
#include "pipeline.h"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>

namespace torch_pipeline {

constexpr int kDefaultMaxWorkerThreads = 4;
constexpr int kMaxWorkerThreadsLimit = 1024;

// The worker-thread cap. Reads TORCH_PIPELINE_MAX_WORKER_THREADS on first call (ValueError if
// it is not an integer in [1, 1024]).
int max_worker_threads();
// Sets the cap. ValueError unless 1 <= n <= 1024; RuntimeError once the cap is in use (a worker
// thread handle, pipeline or task exists), unless n equals the cap in force.
void set_max_worker_threads(int n);

// Called in the child after fork(): replaces the runtime (see runtime.cpp).
void start_new_generation();

class Runtime {
 public:
  // The runtime of the current generation (created on first use, and anew after fork()).
  static Runtime& get();
  static uint64_t current_generation();

  // Called on each worker thread before it sleeps with an empty queue; set once, before any
  // worker starts (the Python layer uses it to release the GIL it holds across a batch).
  static void set_idle_hook(std::function<void()> hook);

  // Throws ValueError (naming the cap) unless 0 <= id < cap. Freezes the cap.
  void check_worker_id(int id);
  core::WorkerThread& worker(int id);
  // The workers created so far.
  std::vector<core::WorkerThread*> workers();

  PipelinePtr create_pipeline(int worker_id, int priority);
  // Every pipeline slot's streams: (worker thread, priority, slot, stream).
  struct SlotStream {
    int worker_id;
    int priority;
    int64_t slot;
    c10::Stream stream;
  };
  std::vector<SlotStream> slot_streams();
  // The worker pool (created on first use; freezes the cap).
  core::WorkerPool& pool();

  // The communication stream of (worker thread, device), created on first use (see comm.h).
  // `device` must be checked by the caller (check_stream_device).
  c10::Stream comm_stream(int worker_id, const c10::Device& device);
  const PipelinePtr& default_pipeline() const { return default_; }

  // Watches non-exclusive streams held by live slots: warns once when two live slots share one.
  void note_live_stream(const c10::Stream& stream);
  void note_dead_stream(const c10::Stream& stream);

  uint64_t generation() const { return generation_; }

 private:
  explicit Runtime(uint64_t generation);
  friend void start_new_generation();

  const uint64_t generation_;
  std::mutex mutex_;
  std::unique_ptr<core::WorkerPool> pool_;
  std::map<std::pair<int, int>, std::unique_ptr<SlotTable>> tables_;
  // (device type, device index, stream id) -> number of live slots holding that stream
  std::map<std::tuple<int, int, c10::StreamId>, int> live_streams_;
  // (worker thread, device type, device index) -> its communication stream
  std::map<std::tuple<int, int, int>, c10::Stream> comm_streams_;
  PipelinePtr default_;
};

}  // namespace torch_pipeline
