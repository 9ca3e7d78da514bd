// Pipelines: cross-device lanes of streams bound to a worker thread (docs/design.md,
// "Concepts").
//
// A PipelineImpl is shared (std::shared_ptr) by everything that keeps the pipeline alive: its
// Python object, every open context that entered it, every queued or running task. When the last
// reference goes, its slot goes back to the SlotTable of its (worker thread, priority), and the
// next pipeline created there takes the same slot and so the same streams.
#pragma once

#include "../core/slot_allocator.h"

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace torch_pipeline {

using DeviceStreams = std::vector<std::pair<c10::Device, c10::Stream>>;

// The slots of one (worker thread, priority) and the streams each slot has acquired. Slot streams
// outlive the pipelines that use them: lifetime-disjoint pipelines reuse them.
class SlotTable {
 public:
  SlotTable(int worker_id, int priority) : worker_id_(worker_id), priority_(priority) {}

  int64_t acquire() { return slots_.acquire(); }
  void release(int64_t slot) { slots_.release(slot); }
  int64_t num_held() const { return slots_.num_held(); }

  // The streams `slot` acquired so far.
  DeviceStreams streams_of(int64_t slot) const;
  // Every slot's streams, by slot (for tools that name streams, e.g. the sim trace).
  std::map<int64_t, DeviceStreams> all_streams() const;
  // The stream of `slot` on `device`, created (exclusive or from the backend's pool) on first use.
  c10::Stream stream(int64_t slot, const c10::Device& device);

  int worker_id() const { return worker_id_; }
  int priority() const { return priority_; }

 private:
  const int worker_id_;
  const int priority_;
  core::SlotAllocator slots_{1};  // slot 0 is the default pipeline's
  mutable std::mutex mutex_;
  std::map<int64_t, DeviceStreams> streams_;
};

class PipelineImpl : public std::enable_shared_from_this<PipelineImpl> {
 public:
  // A pipeline holding `slot` of `table` (the runtime creates these), or, with table == nullptr,
  // the default pipeline (slot 0 of worker thread 0, the current torch streams).
  PipelineImpl(SlotTable* table, int64_t slot, int worker_id, int priority, uint64_t generation);
  ~PipelineImpl();

  PipelineImpl(const PipelineImpl&) = delete;
  PipelineImpl& operator=(const PipelineImpl&) = delete;

  int64_t id() const { return slot_; }
  int worker_id() const { return worker_id_; }
  int priority() const { return priority_; }
  bool is_default() const { return table_ == nullptr; }
  uint64_t generation() const { return generation_; }

  // Throws RuntimeError if the pipeline belongs to the process this one was forked from.
  void check_usable() const;

  // This lane's own stream on `device` (an accelerator device with its index set), acquired on
  // first use. Not for the default pipeline (whose streams are per thread: see context.h).
  c10::Stream own_stream(const c10::Device& device);
  // The streams acquired so far (empty for the default pipeline).
  DeviceStreams own_streams() const;

  // Sequence number (on the worker thread) of the last task submitted to this pipeline.
  void note_task(uint64_t seq);
  uint64_t last_task() const { return last_task_.load(std::memory_order_acquire); }

 private:
  SlotTable* const table_;
  const int64_t slot_;
  const int worker_id_;
  const int priority_;
  const uint64_t generation_;
  mutable std::mutex mutex_;
  DeviceStreams streams_;  // cache of table_->streams_of(slot_)
  std::atomic<uint64_t> last_task_{0};
};

using PipelinePtr = std::shared_ptr<PipelineImpl>;

}  // namespace torch_pipeline
