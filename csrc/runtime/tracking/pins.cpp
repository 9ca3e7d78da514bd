// The task-pins module (see pins.h): TaskPins, the waits of writers for the tasks that pin their
// tensors, and the blocking-wait hook. Touches StorageData::pins, g_pins and the hook.
#include "pins.h"

#include "../../core/worker_pool.h"
#include "../warn.h"
#include "life.h"
#include "storages.h"

#include <algorithm>
#include <condition_variable>

namespace torch_pipeline {
namespace tracking {

struct TaskPins::State {
  State(int worker, uint64_t fork_gen) : worker_id(worker), fork_generation(fork_gen) {}
  const int worker_id;
  const uint64_t fork_generation;  // of this process (pins of a parent do not count in a child)
  std::mutex mutex;
  std::condition_variable cv;
  bool released = false;
};

namespace detail {

namespace {
std::mutex* g_wait_mutex = new std::mutex();  // replaced after fork
BlockingWait* g_blocking_wait = nullptr;      // guarded by *g_wait_mutex
// The pins of the task running on this thread and of the tasks that submitted it
// (TaskPins::Running).
thread_local std::vector<PinPtr> t_running;

bool running_here(const PinPtr& p) {
  return std::find(t_running.begin(), t_running.end(), p) != t_running.end();
}
}  // namespace

// The one place that changes StorageData's pins.
struct PinsAccess {
  static std::vector<PinPtr>& pins(StorageData& d) { return d.pins_; }
};

void blocking_wait(const Step& step) {
  BlockingWait wait;
  {
    std::lock_guard<std::mutex> lock(*g_wait_mutex);
    if (g_blocking_wait != nullptr) {
      wait = *g_blocking_wait;
    }
  }
  if (wait) {
    wait(step);
  } else {
    while (!step(std::chrono::milliseconds(50))) {
    }
  }
}

void reset_pins_after_fork() {
  g_wait_mutex = new std::mutex();  // (the old one may be held by a thread that is gone: leaked)
}

void wait_for_pins(const std::vector<Access>& accesses) {
  if (g_pins.load(std::memory_order_acquire) == 0) {
    return;
  }
  std::vector<PinPtr> wait;
  const int me = core::WorkerThread::current_id();
  {
    LiveState& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    for (const Access& a : accesses) {
      if (!a.write) {
        continue;
      }
      StorageEntry* e = find_storage_locked(st, a.tensor->storage().unsafeGetStorageImpl());
      if (e == nullptr || !e->data.pinned()) {
        continue;
      }
      auto& pins = PinsAccess::pins(e->data);
      pins.erase(std::remove_if(pins.begin(), pins.end(),
                                [](const PinPtr& p) {
                                  std::lock_guard<std::mutex> l(p->mutex);
                                  return p->released;
                                }),
                 pins.end());
      for (const PinPtr& p : pins) {
        if (p->worker_id != me && !running_here(p)) {
          wait.push_back(p);  // (not the task's own work, nor that of a task it submitted)
        }
      }
    }
  }
  for (const PinPtr& p : wait) {
    count(&Counters::pin_waits);
    blocking_wait([&p](std::chrono::milliseconds timeout) {
      std::unique_lock<std::mutex> lock(p->mutex);
      return p->cv.wait_for(lock, timeout, [&] { return p->released; });
    });
  }
}

}  // namespace detail

void set_blocking_wait(BlockingWait wait) {
  std::lock_guard<std::mutex> lock(*detail::g_wait_mutex);
  delete detail::g_blocking_wait;
  detail::g_blocking_wait = wait ? new BlockingWait(std::move(wait)) : nullptr;
}

TaskPins::TaskPins(const std::vector<at::Tensor>& tensors, int worker_id)
    : inherited_(detail::t_running) {
  using namespace detail;
  std::vector<const at::Tensor*> pinned;
  for (const at::Tensor& t : tensors) {
    if (has_data(t)) {
      pinned.push_back(&t);
    }
  }
  if (pinned.empty() || !g_enabled.load()) {
    return;
  }
  state_ = std::make_shared<State>(worker_id, fork_generation());
  g_pins.fetch_add(1);
  update_live(/*settle=*/true);
  observe_this_thread();  // (the submitter's writes must see the pins)
  LiveState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  for (const at::Tensor* t : pinned) {
    PinsAccess::pins(acquire_storage_locked(st, t->storage()).data).push_back(state_);
  }
}

TaskPins::~TaskPins() { release(); }

TaskPins::Running::Running(const TaskPins& pins) : saved_(std::move(detail::t_running)) {
  detail::t_running = pins.inherited_;
  if (pins.state_) {
    detail::t_running.push_back(pins.state_);
  }
}

TaskPins::Running::~Running() { detail::t_running = std::move(saved_); }

void TaskPins::release() {
  using namespace detail;
  if (!state_) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->released) {
      return;
    }
    state_->released = true;
  }
  state_->cv.notify_all();
  if (state_->fork_generation != fork_generation()) {
    return;  // pinned in the parent process: the child's count never included it
  }
  if (g_pins.fetch_sub(1) == 1) {
    try {
      update_live(/*settle=*/false);
    } catch (const std::exception& e) {  // (called from noexcept task paths)
      warn_once("tracking: last pin released",
                std::string("automatic synchronization failed when the last task "
                            "pinning tensors ended (") +
                    e.what() + ")");
    }
  }
}

}  // namespace tracking
}  // namespace torch_pipeline
