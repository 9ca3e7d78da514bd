#include "host_waits.h"

#include "context.h"
#include "devices.h"
#include "event.h"
#include "runtime.h"
#include "tracking.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>

namespace torch_pipeline {
namespace {

std::mutex g_hook_mutex;
BlockHook* g_hook = nullptr;  // set once, leaked

// Wait step for the tasks of `w` up to `seq`.
WaitStep tasks_done_step(core::WorkerThread& w, uint64_t seq) {
  return [&w, seq](std::chrono::milliseconds timeout) { return w.wait_until_done(seq, timeout); };
}

// Inside a task: registers its wait for task `seq` of worker `target` until the result is
// destroyed; RuntimeError, naming the tasks, when the wait would close a cycle of waits across
// worker threads (it could never end). Outside tasks (or seq 0): nothing.
std::optional<core::WorkerPool::WaitGuard> register_task_wait(int target, uint64_t seq) {
  const int self = core::WorkerThread::current_id();
  if (self < 0 || seq == 0) {
    return std::nullopt;
  }
  try {
    return Runtime::get().pool().begin_wait(self, target, seq);
  } catch (const core::WaitCycleError& e) {
    TORCH_CHECK(false, e.what());
  }
  return std::nullopt;  // not reached
}

void synchronize_streams(const DeviceStreams& streams) {
  for (const auto& [device, stream] : streams) {
    block_until([&, d = device, s = stream](std::chrono::milliseconds) {
      c10::impl::getDeviceGuardImpl(d.type())->synchronizeStream(s);
      return true;
    });
  }
}

}  // namespace

void set_block_hook(BlockHook hook) {
  std::lock_guard<std::mutex> lock(g_hook_mutex);
  TORCH_INTERNAL_ASSERT(g_hook == nullptr, "block hook set twice");
  g_hook = new BlockHook(std::move(hook));
}

void block_until(const WaitStep& step, bool interruptible) {
  BlockHook* hook = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_hook_mutex);
    hook = g_hook;
  }
  if (hook != nullptr) {
    (*hook)(step, interruptible);
    return;
  }
  while (!step(kWaitStep)) {
  }
}

void wait_task(const TaskSync& sync) {
  if (!sync.done()) {
    TORCH_CHECK(
        core::WorkerThread::current_id() != sync.worker_id(),
        "waiting, inside a task, for a task queued on the same worker thread (", sync.worker_id(),
        ") would wait forever: a worker thread runs its tasks one at a time, in order. Submit the "
        "inner task to a pipeline of another worker thread, or return its future instead of "
        "waiting for it");
    const auto registered = register_task_wait(sync.worker_id(), sync.seq());
    block_until([&](std::chrono::milliseconds timeout) {
      TORCH_CHECK(
          sync.generation() == Runtime::current_generation(),
          "this task was submitted before os.fork(), in the parent process; it does not run in "
          "the child, so its future never completes there");
      return sync.wait_for(timeout);
    });
  }
  sync.block_current_streams();
}

bool pipeline_tasks_done(const PipelineImpl& p) {
  p.check_usable();
  const uint64_t seq = p.last_task();
  return seq == 0 || Runtime::get().worker(p.worker_id()).completed() >= seq;
}

void wait_pipeline_tasks(const PipelineImpl& p) {
  p.check_usable();
  const uint64_t seq = p.last_task();
  if (seq == 0 || core::WorkerThread::current_id() == p.worker_id()) {
    return;
  }
  const auto registered = register_task_wait(p.worker_id(), seq);
  block_until(tasks_done_step(Runtime::get().worker(p.worker_id()), seq));
}

DeviceStreams existing_streams(PipelineImpl& p) {
  p.check_usable();
  return p.is_default() ? lane_streams(p) : p.own_streams();
}

bool query_pipeline(PipelineImpl& p) {
  if (!pipeline_tasks_done(p)) {
    return false;
  }
  for (const auto& [device, stream] : existing_streams(p)) {
    if (!c10::impl::getDeviceGuardImpl(device.type())->queryStream(stream)) {
      return false;
    }
  }
  return true;
}

void synchronize_pipeline(PipelineImpl& p) {
  wait_pipeline_tasks(p);
  synchronize_streams(existing_streams(p));
  tracking::poll();  // memory kept alive for uses now complete goes back
}

void wait_pipeline(PipelineImpl& waiter, PipelineImpl& other) {
  waiter.check_usable();
  other.check_usable();
  if (&waiter == &other) {
    return;
  }
  PipelineEvent e(false);
  e.record(other);
  e.wait(waiter);
}

void synchronize_all() {
  TORCH_CHECK(
      core::WorkerThread::current_id() < 0,
      "torch_pipeline.synchronize() waits for every worker thread, so it cannot be called from a "
      "task (it would wait for itself); use Pipeline.synchronize() or the futures of the tasks");
  for (core::WorkerThread* w : Runtime::get().workers()) {
    block_until(tasks_done_step(*w, w->submitted()));
  }
  for (const c10::Device& d : initialized_accelerator_devices()) {
    block_until([&d](std::chrono::milliseconds) {
      c10::impl::getDeviceGuardImpl(d.type())->synchronizeDevice(d.index());
      return true;
    });
  }
  tracking::poll();  // memory kept alive for uses now complete goes back
}

DrainResult drain_tasks(double timeout_s) {
  using clock = std::chrono::steady_clock;
  const bool bounded = timeout_s >= 0 && std::isfinite(timeout_s);
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(bounded ? timeout_s : 0));
  auto expired = [&] { return bounded && clock::now() >= deadline; };
  DrainResult out;
  out.finished = false;
  out.why = "the exit timeout (TORCH_PIPELINE_EXIT_TIMEOUT) passed";
  try {
    // Tasks may queue more tasks while we drain: repeat until a pass finds nothing new.
    for (;;) {
      bool clean_pass = true;
      for (core::WorkerThread* w : Runtime::get().workers()) {
        const uint64_t seq = w->submitted();
        if (w->completed() >= seq) {
          continue;
        }
        clean_pass = false;
        block_until([&](std::chrono::milliseconds step) {
          if (bounded) {
            const auto left = deadline - clock::now();
            if (left <= clock::duration::zero()) {
              return true;
            }
            step = std::min(step, std::chrono::duration_cast<std::chrono::milliseconds>(left) +
                                      std::chrono::milliseconds(1));
          }
          return w->wait_until_done(seq, step);
        });
        if (expired()) {
          break;
        }
      }
      if (clean_pass) {
        out.finished = true;
        break;
      }
      if (expired()) {
        break;
      }
    }
  } catch (const std::exception& e) {  // Ctrl-C while waiting (KeyboardInterrupt)
    out.why = std::string("waiting was interrupted (") + e.what() + ")";
  }
  if (!out.finished) {
    const std::string reason =
        "torch_pipeline: task cancelled at interpreter exit before it "
        "started, because " +
        out.why;
    for (core::WorkerThread* w : Runtime::get().workers()) {
      out.cancelled += w->cancel_pending(reason);
      out.running += w->busy() ? 1 : 0;
    }
  }
  return out;
}

}  // namespace torch_pipeline
