#include "stream_queue.h"

#include <cstdio>
#include <exception>
#include <utility>

namespace torch_pipeline {
namespace core {

StreamQueue::StreamQueue(uint64_t base, ThreadStart on_start, ErrorSink on_error)
    : on_start_(std::move(on_start)),
      on_error_(std::move(on_error)),
      enqueued_(base),
      completed_(base) {}

StreamQueue::~StreamQueue() { shutdown(); }

uint64_t StreamQueue::enqueue(Work work, std::chrono::nanoseconds min_duration) {
  destroy_finished();
  uint64_t seq = 0;
  std::thread exited;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(Entry{std::move(work), min_duration});
    seq = enqueued_.load(std::memory_order_relaxed) + 1;
    enqueued_.store(seq, std::memory_order_release);
    stopping_ = false;  // a shutdown() in progress leaves the thread running
    if (exited_) {
      exited = std::move(thread_);  // Note [An enqueue after the loop exited]
    }
    if (!thread_.joinable()) {
      exited_ = false;
      thread_ = std::thread([this] { loop(); });
    }
  }
  work_cv_.notify_one();
  if (exited.joinable()) {
    exited.join();  // it has left its loop and never takes the lock again
  }
  return seq;
}

uint64_t StreamQueue::enqueue_wait(StreamQueue& other, uint64_t seq) {
  if (&other == this || other.reached(seq)) {
    return enqueued();  // ordered already (FIFO) or complete: nothing to wait for
  }
  return enqueue([&other, seq] { other.wait(seq, /*collect=*/false); });
}

void StreamQueue::wait(uint64_t seq, bool collect) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return completed_.load(std::memory_order_acquire) >= seq; });
  }
  if (collect) {
    destroy_finished();
  }
}

// Note [An enqueue after the loop exited]
// The thread leaves its loop when it is stopping and the queue is empty, and shutdown() takes it
// to join only when it next holds the lock. An enqueue in between finds the thread joinable but
// gone: it must start a new one, or its entry stays queued with no thread and every wait for it
// hangs. (The sim's exit shuts the queues down while daemon threads still launch kernels: that
// hung a child in the exit tests.) The new thread cancels the stop, as any enqueue during a
// shutdown does; shutdown() then returns without joining.
void StreamQueue::shutdown() {
  std::thread thread;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!thread_.joinable()) {
      return;
    }
    stopping_ = true;
    work_cv_.notify_one();
    // The thread runs what is queued first. An enqueue meanwhile cancels the stop.
    done_cv_.wait(lock, [&] { return exited_ || !stopping_; });
    if (!exited_) {
      return;
    }
    thread = std::move(thread_);
  }
  thread.join();
  destroy_finished();
}

bool StreamQueue::running() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return thread_.joinable();
}

void StreamQueue::destroy_finished() {
  std::vector<Work> finished;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finished.swap(finished_);
  }
  // destroyed here, on the calling thread
}

void StreamQueue::report(const std::string& message) {
  if (on_error_) {
    on_error_(message);
  } else {
    std::fprintf(stderr, "torch_pipeline: work on a stream queue raised: %s\n", message.c_str());
  }
}

void StreamQueue::loop() {
  if (on_start_) {
    on_start_();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) {
      exited_ = true;  // stopping, and everything ran
      done_cv_.notify_all();
      return;
    }
    Entry entry = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    if (entry.min_duration.count() > 0) {
      std::this_thread::sleep_for(entry.min_duration);  // the work lands at the end
    }
    try {
      entry.work();
    } catch (const std::exception& e) {
      report(e.what());
    } catch (...) {
      report("unknown exception");
    }
    lock.lock();
    finished_.push_back(std::move(entry.work));
    completed_.store(completed_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    done_cv_.notify_all();
  }
}

}  // namespace core
}  // namespace torch_pipeline
