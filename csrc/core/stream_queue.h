// Plain C++17 (no torch includes): the device queue of one simulated stream (the sim device's
// asynchronous mode, docs/design.md, "Asynchronous mode and the latency model").
//
// Work enqueued on a StreamQueue runs on the queue's own thread, in FIFO order, like kernels on a
// CUDA stream. Every entry gets a sequence number (1, 2, ...); completed() is the number of the
// last entry that finished, so every entry up to it is done. An entry may take a duration (a
// modelled device time): the thread sleeps for it, then runs the work, so the entry's effects land
// at its end, as a kernel's results are there when it completes; sleeping rather than spinning,
// queues overlap in time even on a machine with few cores. A wait entry (enqueue_wait) blocks the
// queue until another queue completed a given number: a stream waiting for an event. Waits only
// name numbers that were enqueued before, so queues never wait for each other in a cycle.
//
// The thread starts at the first enqueue; shutdown() drains and joins it (a later enqueue starts
// a new one). Finished work objects are destroyed by the next thread that enqueues on, waits for
// or shuts down the queue, never by the queue's thread: they may own objects whose release needs
// locks the host holds while it waits (a Python object needs the GIL).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace torch_pipeline {
namespace core {

class StreamQueue {
 public:
  using Work = std::function<void()>;
  // Called on the queue's thread when it starts (e.g. to set thread-local state of a library).
  using ThreadStart = std::function<void()>;
  // Where an exception that escapes a work item is reported (the queue goes on with the next
  // entry). Default: a line on stderr.
  using ErrorSink = std::function<void(const std::string& message)>;

  // `base`: the sequence number the queue starts from (a queue that replaces one lost at fork()
  // continues its numbering, so events recorded before stay complete).
  explicit StreamQueue(uint64_t base = 0, ThreadStart on_start = {}, ErrorSink on_error = {});
  ~StreamQueue();  // shutdown()

  StreamQueue(const StreamQueue&) = delete;
  StreamQueue& operator=(const StreamQueue&) = delete;

  // Queues `work` and returns its sequence number; on the queue's thread it runs after sleeping
  // `min_duration`. Starts the thread when it is not running.
  uint64_t enqueue(Work work, std::chrono::nanoseconds min_duration = std::chrono::nanoseconds(0));
  // Queues an entry that blocks this queue until `other` completed `seq`. Returns its number.
  uint64_t enqueue_wait(StreamQueue& other, uint64_t seq);

  uint64_t enqueued() const { return enqueued_.load(std::memory_order_acquire); }
  uint64_t completed() const { return completed_.load(std::memory_order_acquire); }
  bool reached(uint64_t seq) const { return completed() >= seq; }
  // Blocks the caller until completed() >= seq (seq <= enqueued()); then, with `collect`,
  // destroys the finished work (another queue's thread waiting in a wait entry does not).
  void wait(uint64_t seq, bool collect = true);
  void drain() { wait(enqueued()); }
  // Runs what is queued, then stops and joins the thread.
  void shutdown();
  bool running() const;

 private:
  struct Entry {
    Work work;
    std::chrono::nanoseconds min_duration;
  };
  void loop();
  void report(const std::string& message);
  void destroy_finished();  // on the calling thread, outside the lock

  const ThreadStart on_start_;
  const ErrorSink on_error_;
  mutable std::mutex mutex_;
  std::condition_variable work_cv_;  // entries or stop
  std::condition_variable done_cv_;  // completed_ grew
  std::deque<Entry> queue_;
  std::vector<Work> finished_;  // run, waiting to be destroyed by a caller
  std::atomic<uint64_t> enqueued_;
  std::atomic<uint64_t> completed_;
  bool stopping_ = false;
  bool exited_ = false;  // the thread left its loop (shutdown() joins it)
  std::thread thread_;
};

}  // namespace core
}  // namespace torch_pipeline
