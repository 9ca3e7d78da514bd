#include "executor.h"

#include "fork.h"
#include "host.h"
#include "latency.h"
#include "state.h"
#include "trace.h"

#include "../core/stream_queue.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace sim {
namespace {

std::atomic<bool> g_async{false};
// The queues, by timeline (made lazily, leaked: a queue is never destroyed while the device is
// up). The lock guards the vector only; queues have their own.
std::mutex g_mutex;
std::vector<core::StreamQueue*>* g_queues = new std::vector<core::StreamQueue*>();
std::mutex g_error_mutex;  // a leaf
std::string* g_error = new std::string();

void note_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  if (g_error->empty()) {
    *g_error = message;
  }
}

// A queue's thread is the device: the CPU ops its kernels run are the device's internals, not
// ops of the program, so RecordFunction is off there. (Observed, they would look like the
// program's ops to automatic synchronization, which could make the device wait for itself: a
// queued copy into watched host memory waiting for that very copy.) Grad mode is off too: a
// kernel is below autograd, as a CUDA kernel is, and must never add to the program's graph.
// (On, a queued copy into a tensor that autograd had since made an op's output gave it a
// CopyBackwards: backward through a non_blocking copy to the host gave zero gradients.)
core::StreamQueue* make_queue(uint64_t base) {
  const int threads = at::get_num_threads();
  return new core::StreamQueue(
      base,
      [threads] {
        at::set_num_threads(threads);
        at::enableRecordFunction(false);
        c10::GradMode::set_enabled(false);
      },
      &note_error);
}

// The queue of `t`, made when `create`; nullptr when it has none.
core::StreamQueue* queue_of(Timeline t, bool create) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& queues = *g_queues;
  const auto i = static_cast<size_t>(t);
  if (i >= queues.size()) {
    if (!create) {
      return nullptr;
    }
    queues.resize(i + 1, nullptr);
  }
  if (queues[i] == nullptr && create) {
    queues[i] = make_queue(0);
  }
  return queues[i];
}

std::vector<core::StreamQueue*> all_queues() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<core::StreamQueue*> out;
  for (auto* q : *g_queues) {
    if (q != nullptr) out.push_back(q);
  }
  return out;
}

// The queued form of `work`: a kernel's exception is kept for the next synchronizing call.
std::function<void()> guarded(Timeline t, const std::string& op, std::function<void()> work) {
  return [t, op, work = std::move(work)] {
    SimKernelScope kernel;  // the CPU ops it runs are the device's
    try {
      work();
    } catch (const c10::Error& e) {
      note_error(op + " on " + State::get().checker().label(t) + ": " + e.what_without_backtrace());
    } catch (const std::exception& e) {
      note_error(op + " on " + State::get().checker().label(t) + ": " + e.what());
    }
  };
}

}  // namespace

bool asynchronous() { return g_async.load(std::memory_order_acquire); }

void set_asynchronous(bool on) {
  if (!on) {
    for (auto* q : all_queues()) {
      q->shutdown();  // runs what is queued first
    }
  }
  g_async.store(on, std::memory_order_release);
}

void launch(Timeline t, const std::string& op, size_t bytes, std::function<void()> work) {
  const auto time = modelled_time(op, bytes);
  if (!asynchronous()) {
    const int64_t begin = trace::on() ? trace::now_ns() : 0;
    work();
    if (time.count() > 0) {
      std::this_thread::sleep_for(time);
    }
    if (begin != 0) {
      trace::kernel(t, op, begin, trace::now_ns());
    }
    return;
  }
  if (trace::on()) {  // (the queue's thread sleeps for `time` before it runs the work)
    const int64_t modelled = std::chrono::duration_cast<std::chrono::nanoseconds>(time).count();
    work = [t, op, modelled, work = std::move(work)] {
      const int64_t begin = trace::now_ns() - modelled;
      work();
      trace::kernel(t, op, begin, trace::now_ns());
    };
  }
  queue_of(t, true)->enqueue(guarded(t, op, std::move(work)), time);
}

uint64_t launch_marker(Timeline t, std::function<void()> work) {
  if (!asynchronous()) {
    work();
    return 0;
  }
  return queue_of(t, true)->enqueue(std::move(work));
}

uint64_t stream_position(Timeline t) {
  core::StreamQueue* q = queue_of(t, false);
  return q != nullptr ? q->enqueued() : 0;
}

bool stream_reached(Timeline t, uint64_t position) {
  core::StreamQueue* q = queue_of(t, false);
  return q == nullptr || q->reached(position);
}

void host_wait(Timeline t, uint64_t position, bool report) {
  if (core::StreamQueue* q = queue_of(t, false)) {
    q->wait(position);
  }
  if (report) {
    check_async_error();
  }
}

void host_wait(Timeline t, bool report) { host_wait(t, stream_position(t), report); }

void stream_wait(Timeline waiter, Timeline t, uint64_t position) {
  if (!asynchronous() || waiter == t || stream_reached(t, position)) {
    return;
  }
  core::StreamQueue* other = queue_of(t, false);
  if (other != nullptr) {
    queue_of(waiter, true)->enqueue_wait(*other, position);
  }
}

void check_async_error() {
  std::string message;
  {
    std::lock_guard<std::mutex> lock(g_error_mutex);
    message.swap(*g_error);
  }
  TORCH_CHECK(message.empty(),
              "sim: a kernel queued earlier failed on its stream (asynchronous mode "
              "reports kernel errors at the next synchronizing call, as CUDA does): ",
              message);
}

void shutdown_executors() { set_asynchronous(false); }

size_t running_executors() {
  size_t n = 0;
  for (auto* q : all_queues()) {
    n += q->running() ? 1 : 0;
  }
  return n;
}

void lock_executors_for_fork() {
  g_mutex.lock();
  g_error_mutex.lock();
}

void unlock_executors_after_fork() {
  g_error_mutex.unlock();
  g_mutex.unlock();
}

void reset_executors_in_child() {
  // The parent's queues have no thread here and may have been locked by one: leak them. Their
  // queued work never runs in the child; numbering continues, so events recorded before are
  // complete.
  for (auto*& q : *g_queues) {
    if (q != nullptr) {
      q = make_queue(q->enqueued());
    }
  }
}

}  // namespace sim
}  // namespace torch_pipeline
