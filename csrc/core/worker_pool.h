// Plain C++17 (no torch includes): the capped pool of long-lived worker threads.
//
// Each WorkerThread runs the tasks submitted to it in FIFO order on one std::thread, started
// lazily by the first submit. No busy waiting: an idle worker sleeps on a condition variable.
// Every submit gets a sequence number; `wait_until_done(seq)` waits until the task with that
// number (and so, by FIFO order, every earlier one) has finished running or has been cancelled.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace torch_pipeline {
namespace core {

// A unit of work for a WorkerThread. Exactly one of run() / cancel() is called, once.
// Where a worker thread reports an exception that escaped a task or the idle hook (a bug: tasks
// catch their own). Default: a line on stderr. The runtime installs one that warns through
// torch's warning machinery (Python warnings). Set it before worker threads start.
using ErrorReport = void (*)(const std::string& message);
void set_error_report(ErrorReport report);

class Task {
 public:
  virtual ~Task() = default;
  // Runs on the worker thread. Should not throw: a std::exception escaping it is caught and
  // reported (set_error_report), and the worker goes on with the next task.
  virtual void run() = 0;
  // Called instead of run() when the task is dropped before it started (cancel_pending).
  // Called on the thread that cancels, never with a worker lock held.
  virtual void cancel(const std::string& reason) noexcept = 0;
  // What the task is, for error messages (e.g. "a task of pipeline id=1"). Called with the
  // worker's lock held: must not block or take other locks. Default: "a task".
  virtual std::string describe() const { return "a task"; }
};

// Thrown by WorkerPool::begin_wait when a wait could never end (a cycle of waits across worker
// threads); what() describes each task of the cycle.
class WaitCycleError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class WorkerThread {
 public:
  // `on_idle` (may be empty) is called on the worker thread, with no lock held, each time the
  // worker has run everything queued and is about to sleep: the Python layer uses it to let go of
  // the GIL that it keeps across a batch of Python tasks.
  WorkerThread(int id, std::function<void()> on_idle);
  // Stops the thread: lets it finish the task it is running, cancels the queued ones, joins.
  ~WorkerThread();

  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;

  int id() const { return id_; }

  // Queues `task` (FIFO) and returns its sequence number (1, 2, ...). Starts the thread on first
  // use. Throws std::runtime_error after shutdown().
  uint64_t submit(std::unique_ptr<Task> task);

  // Sequence number of the last task submitted (0 if none) / of the last one finished or
  // cancelled. Tasks finish in order, so every task with a number <= completed() is done.
  uint64_t submitted() const;
  uint64_t completed() const;

  // Waits until completed() >= seq or the timeout passes; returns whether it did.
  bool wait_until_done(uint64_t seq, std::chrono::milliseconds timeout);

  // Removes every queued task that has not started and cancels it with `reason` (outside the
  // lock); the running one, if any, goes on. Returns how many were cancelled.
  size_t cancel_pending(const std::string& reason);

  // Refuses further submits; if `cancel_queued`, cancels the queued tasks; wakes the thread and
  // joins it once it has finished what it runs (and, unless cancelled, what is queued).
  void shutdown(bool cancel_queued);

  // Whether the calling thread is this worker's thread.
  bool is_current_thread() const;
  bool started() const;
  // Whether a task is running right now.
  bool busy() const;
  // describe() of the task numbered `seq` if it is running or queued, else "" (done/unknown).
  std::string describe_task(uint64_t seq) const;
  // Number of queued tasks that have not started.
  size_t pending() const;

  // Id of the WorkerThread whose thread is calling, or -1 on any other thread.
  static int current_id();

 private:
  void loop();
  // Records that the tasks numbered first..last have finished or been cancelled, and advances
  // completed_ over every number that is now done. Caller holds mutex_.
  void finish_locked(uint64_t first, uint64_t last);

  const int id_;
  const std::function<void()> on_idle_;
  mutable std::mutex mutex_;
  std::condition_variable work_cv_;  // signalled on submit and shutdown
  std::condition_variable done_cv_;  // signalled when completed_ grows
  std::deque<std::unique_ptr<Task>> queue_;
  uint64_t submitted_ = 0;
  uint64_t completed_ = 0;
  // Ranges [first, last] (keyed by first) done out of order: queued tasks cancelled while an
  // earlier task was still running. completed_ only moves over a number once everything before it
  // is done.
  std::map<uint64_t, uint64_t> finished_ahead_;
  bool running_task_ = false;
  uint64_t running_seq_ = 0;       // number of the running task (while running_task_)
  const Task* running_ = nullptr;  // the running task (while running_task_)
  bool stopping_ = false;
  bool started_ = false;
  std::thread thread_;
  std::thread::id thread_id_;
};

// The capped set of worker threads (ids 0 .. cap-1). WorkerThread objects are created on first
// access; their threads start on first submit.
class WorkerPool {
 public:
  WorkerPool(int cap, std::function<void()> on_idle);
  ~WorkerPool();  // shuts every worker down (cancelling queued tasks)

  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int cap() const { return cap_; }
  // Throws std::out_of_range, naming the cap, if id is not in [0, cap).
  WorkerThread& worker(int id);
  // The workers created so far (not necessarily started).
  std::vector<WorkerThread*> created() const;
  // shutdown(cancel_queued) on every created worker.
  void shutdown(bool cancel_queued);

  // Registration of a task's wait for another worker's task: while it lives, the task running on
  // worker `waiter` is blocked until worker `target` has completed task `seq`.
  class WaitGuard {
   public:
    WaitGuard(WaitGuard&& other) noexcept;
    WaitGuard& operator=(WaitGuard&&) = delete;
    WaitGuard(const WaitGuard&) = delete;
    ~WaitGuard();

   private:
    friend class WorkerPool;
    WaitGuard(WorkerPool* pool, int waiter) : pool_(pool), waiter_(waiter) {}
    WorkerPool* pool_;  // null: nothing registered
    int waiter_;
  };
  // Called on worker `waiter`'s thread by a task about to block until worker `target` has
  // completed task `seq`. Throws WaitCycleError, naming each task, when that could never happen:
  // following what each worker's running task waits for, from (target, seq), leads back to
  // `waiter` itself (its running task, or one queued behind it, can then never run). Otherwise
  // registers the wait until the guard is destroyed. Of two tasks closing a cycle at the same
  // time, the later one to register gets the error.
  [[nodiscard]] WaitGuard begin_wait(int waiter, int target, uint64_t seq);

 private:
  struct Wait {
    int target;
    uint64_t seq;
  };
  void end_wait(int waiter);

  const int cap_;
  const std::function<void()> on_idle_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<WorkerThread>> workers_;  // size cap_, created lazily
  std::mutex waits_mutex_;     // taken before any worker's lock, never after
  std::map<int, Wait> waits_;  // waiting worker -> what its running task waits for
};

}  // namespace core
}  // namespace torch_pipeline
