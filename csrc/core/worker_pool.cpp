#include "worker_pool.h"

#include <atomic>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

namespace torch_pipeline {
namespace core {

namespace {
void report_to_stderr(const std::string& message) {
  std::fprintf(stderr, "torch_pipeline: %s\n", message.c_str());
}
std::atomic<ErrorReport> g_error_report{&report_to_stderr};

void report_error(const std::string& message) {
  g_error_report.load(std::memory_order_acquire)(message);
}
}  // namespace

void set_error_report(ErrorReport report) {
  g_error_report.store(report != nullptr ? report : &report_to_stderr, std::memory_order_release);
}

namespace {

// The WorkerThread whose loop() runs on the calling thread, or null.
thread_local const WorkerThread* t_current_worker = nullptr;

std::string shut_down_message(int id) {
  return "torch_pipeline: worker thread " + std::to_string(id) + " is shut down";
}

// Cancels every task in `tasks`, in order, on the calling thread (no lock may be held), destroying
// each one right after its cancel() so that whatever it owns is released before it counts as done.
void cancel_all(std::deque<std::unique_ptr<Task>>& tasks, const std::string& reason) {
  for (auto& task : tasks) {
    task->cancel(reason);
    task.reset();
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// WorkerThread

WorkerThread::WorkerThread(int id, std::function<void()> on_idle)
    : id_(id), on_idle_(std::move(on_idle)) {}

WorkerThread::~WorkerThread() {
  shutdown(/*cancel_queued=*/true);
  // shutdown() joins unless it runs on the worker thread itself, i.e. the WorkerThread is being
  // destroyed from inside one of its own tasks. A thread cannot join itself and destroying a
  // joinable std::thread terminates, so let it go; using the object after that is the caller's bug.
  if (thread_.joinable()) thread_.detach();
}

uint64_t WorkerThread::submit(std::unique_ptr<Task> task) {
  if (!task) throw std::invalid_argument("torch_pipeline: submit() was given a null task");
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stopping_) {
      if (!started_) {
        // Started under the lock: loop() blocks on mutex_ until the task below is queued.
        thread_ = std::thread([this] { loop(); });
        thread_id_ = thread_.get_id();
        started_ = true;
      }
      queue_.push_back(std::move(task));
      seq = ++submitted_;
    }
  }
  if (seq != 0) {
    // Notified after unlocking, so that the woken worker does not block on mutex_ at once.
    work_cv_.notify_one();
    return seq;
  }
  // Refused. Keep the Task contract (exactly one of run()/cancel() is called), outside the lock.
  const std::string message = shut_down_message(id_);
  task->cancel(message);
  task.reset();
  throw std::runtime_error(message);
}

uint64_t WorkerThread::submitted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return submitted_;
}

uint64_t WorkerThread::completed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

bool WorkerThread::wait_until_done(uint64_t seq, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  std::unique_lock<std::mutex> lock(mutex_);
  const auto done = [&] { return completed_ >= seq; };
  if (done()) return true;
  if (timeout <= std::chrono::milliseconds::zero()) return false;
  const Clock::time_point now = Clock::now();
  // A timeout beyond the clock's range (e.g. milliseconds::max() for "forever") would overflow
  // now + timeout; wait without a deadline instead. Compared in milliseconds: converting a huge
  // millisecond count to the clock's nanoseconds would itself overflow.
  const auto headroom =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now);
  if (timeout >= headroom) {
    done_cv_.wait(lock, done);
    return true;
  }
  return done_cv_.wait_until(lock, now + timeout, done);
}

size_t WorkerThread::cancel_pending(const std::string& reason) {
  std::deque<std::unique_ptr<Task>> dropped;
  uint64_t first = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.empty()) return 0;
    dropped.swap(queue_);
    // The queue holds the tasks numbered submitted_ - size + 1 .. submitted_.
    first = submitted_ - dropped.size() + 1;
  }
  const size_t count = dropped.size();
  cancel_all(dropped, reason);
  std::lock_guard<std::mutex> lock(mutex_);
  finish_locked(first, first + count - 1);
  return count;
}

void WorkerThread::shutdown(bool cancel_queued) {
  std::deque<std::unique_ptr<Task>> dropped;
  uint64_t first = 0;
  std::thread to_join;
  const bool on_own_thread = is_current_thread();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    if (cancel_queued && !queue_.empty()) {
      dropped.swap(queue_);
      first = submitted_ - dropped.size() + 1;
    }
    // Exactly one caller takes the thread to join it, so concurrent shutdowns never join twice.
    // The worker never takes itself: it would deadlock joining itself. It leaves thread_ for a
    // later shutdown() from another thread (or the destructor) to join once loop() has returned.
    if (!on_own_thread && thread_.joinable()) to_join = std::move(thread_);
    work_cv_.notify_all();
  }
  if (!dropped.empty()) {
    const size_t count = dropped.size();
    cancel_all(dropped, shut_down_message(id_));
    std::lock_guard<std::mutex> lock(mutex_);
    finish_locked(first, first + count - 1);
  }
  if (to_join.joinable()) {
    to_join.join();
  } else if (!on_own_thread) {
    // Another caller is joining the thread (or it never started): still return only once the
    // worker has finished what it runs and, unless cancelled, what is queued.
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return queue_.empty() && !running_task_; });
  }
}

bool WorkerThread::is_current_thread() const { return t_current_worker == this; }

bool WorkerThread::started() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return started_;
}

bool WorkerThread::busy() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return running_task_;
}

size_t WorkerThread::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size();
}

std::string WorkerThread::describe_task(uint64_t seq) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (seq <= completed_ || seq > submitted_) return "";
  if (running_task_ && seq == running_seq_) return running_->describe();
  const uint64_t first_queued = submitted_ - queue_.size() + 1;
  if (seq >= first_queued) return queue_[static_cast<size_t>(seq - first_queued)]->describe();
  return "";  // cancelled out of order, or between dequeue and run
}

int WorkerThread::current_id() { return t_current_worker != nullptr ? t_current_worker->id_ : -1; }

void WorkerThread::finish_locked(uint64_t first, uint64_t last) {
  if (first != completed_ + 1) {
    // An earlier task is still running (these were cancelled from the queue behind it) or an
    // earlier range is still being cancelled: remember these until the gap closes.
    finished_ahead_.emplace(first, last);
    return;
  }
  completed_ = last;
  for (auto it = finished_ahead_.begin();
       it != finished_ahead_.end() && it->first == completed_ + 1; it = finished_ahead_.erase(it)) {
    completed_ = it->second;
  }
  done_cv_.notify_all();
}

// Note on exceptions: only std::exception is caught, never `...`. A pthread cancellation (forced
// unwind) must be able to pass through this loop; swallowing it would abort the process.
void WorkerThread::loop() {
  t_current_worker = this;
  // Whether a task has run since on_idle_ was last called: on_idle_ marks the end of a batch, so it
  // is not called on wake-ups that ran nothing.
  bool ran_since_idle = false;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (queue_.empty()) {
      if (ran_since_idle && on_idle_) {
        // About to sleep (or to exit): call on_idle_ without the lock, then look again, since a
        // task may have been queued meanwhile.
        ran_since_idle = false;
        lock.unlock();
        try {
          on_idle_();
        } catch (const std::exception& e) {
          report_error("worker thread " + std::to_string(id_) + ": on_idle raised: " + e.what());
        }
        lock.lock();
        continue;
      }
      if (stopping_) break;
      work_cv_.wait(lock, [&] { return !queue_.empty() || stopping_; });
      continue;
    }

    std::unique_ptr<Task> task = std::move(queue_.front());
    queue_.pop_front();
    // What is still queued is numbered up to submitted_, so this task is the one just before.
    const uint64_t seq = submitted_ - queue_.size();
    running_task_ = true;
    running_seq_ = seq;
    running_ = task.get();
    lock.unlock();

    try {
      task->run();
    } catch (const std::exception& e) {
      report_error("worker thread " + std::to_string(id_) + ": task raised: " + e.what());
    }
    lock.lock();
    running_ = nullptr;  // before the task goes: describe_task() may look at it under the lock
    lock.unlock();
    task.reset();  // release what the task owns before it counts as done

    lock.lock();
    running_task_ = false;
    ran_since_idle = true;
    finish_locked(seq, seq);
  }
  t_current_worker = nullptr;
}

// ---------------------------------------------------------------------------------------------
// WorkerPool

namespace {

int checked_cap(int cap) {
  if (cap < 1) {
    throw std::invalid_argument("torch_pipeline: the worker thread cap must be at least 1, got " +
                                std::to_string(cap));
  }
  return cap;
}

}  // namespace

WorkerPool::WorkerPool(int cap, std::function<void()> on_idle)
    : cap_(checked_cap(cap)), on_idle_(std::move(on_idle)), workers_(static_cast<size_t>(cap_)) {}

WorkerPool::~WorkerPool() { shutdown(/*cancel_queued=*/true); }

WorkerThread& WorkerPool::worker(int id) {
  if (id < 0 || id >= cap_) {
    const std::string threads = cap_ == 1 ? "1 worker thread (id 0)"
                                          : std::to_string(cap_) + " worker threads (ids 0.." +
                                                std::to_string(cap_ - 1) + ")";
    throw std::out_of_range("torch_pipeline: worker thread id " + std::to_string(id) +
                            " is out of range: the pool has " + threads +
                            "; raise the cap with set_max_worker_threads(n) before first use or "
                            "TORCH_PIPELINE_MAX_WORKER_THREADS");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  std::unique_ptr<WorkerThread>& slot = workers_[static_cast<size_t>(id)];
  if (!slot) slot = std::make_unique<WorkerThread>(id, on_idle_);
  return *slot;
}

std::vector<WorkerThread*> WorkerPool::created() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<WorkerThread*> out;
  for (const auto& w : workers_) {
    if (w) out.push_back(w.get());
  }
  return out;
}

void WorkerPool::shutdown(bool cancel_queued) {
  // Not under mutex_: shutting a worker down waits for its running task, which may itself call
  // worker() on this pool.
  const std::vector<WorkerThread*> workers = created();
  if (cancel_queued) {
    // Empty every queue first: the workers are joined one at a time, and a worker waiting for its
    // turn must not go on running tasks that this shutdown is meant to cancel.
    for (WorkerThread* w : workers) w->cancel_pending(shut_down_message(w->id()));
  }
  for (WorkerThread* w : workers) w->shutdown(cancel_queued);
}

// ---------------------------------------------------------------------------------------------
// Waits across worker threads

WorkerPool::WaitGuard::WaitGuard(WaitGuard&& other) noexcept
    : pool_(other.pool_), waiter_(other.waiter_) {
  other.pool_ = nullptr;
}

WorkerPool::WaitGuard::~WaitGuard() {
  if (pool_ != nullptr) pool_->end_wait(waiter_);
}

namespace {

std::string task_label(WorkerThread& w, uint64_t seq) {
  std::string what = w.describe_task(seq);
  if (what.empty()) what = "a task";
  return what + " on worker thread " + std::to_string(w.id()) + " (its task #" +
         std::to_string(seq) + ")";
}

}  // namespace

WorkerPool::WaitGuard WorkerPool::begin_wait(int waiter, int target, uint64_t seq) {
  worker(waiter);  // checks the id
  std::lock_guard<std::mutex> lock(waits_mutex_);
  // The chain of waits: (worker, the task number it must complete) for each hop.
  std::vector<std::pair<int, uint64_t>> chain{{target, seq}};
  for (;;) {
    const auto [id, need] = chain.back();
    WorkerThread& w = worker(id);
    if (w.completed() >= need) break;  // done, or about to be: no cycle through here
    if (id == waiter) {
      // `waiter` would have to complete `need`, which is its running task or one behind it.
      std::string message =
          "torch_pipeline: these waits could never end (a cycle of waits across worker threads, "
          "each of which runs its tasks one at a time, in order): ";
      int from = waiter;
      for (size_t i = 0; i < chain.size(); ++i) {
        // A waiting worker's running task is the one after those completed (FIFO).
        WorkerThread& src = worker(from);
        message += (i == 0 ? "" : "; ") + task_label(src, src.completed() + 1) + " waits for " +
                   task_label(worker(chain[i].first), chain[i].second);
        from = chain[i].first;
      }
      message +=
          ". Wait for another worker thread's task only where no task of that worker "
          "waits back (or from outside tasks), or return the future instead of waiting";
      throw WaitCycleError(message);
    }
    const auto it = waits_.find(id);
    if (it == waits_.end()) break;  // w's running task is not blocked on another worker
    if (chain.size() > static_cast<size_t>(cap_)) break;  // a cycle not through `waiter`
    chain.emplace_back(it->second.target, it->second.seq);
  }
  waits_[waiter] = Wait{target, seq};
  return WaitGuard(this, waiter);
}

void WorkerPool::end_wait(int waiter) {
  std::lock_guard<std::mutex> lock(waits_mutex_);
  waits_.erase(waiter);
}

}  // namespace core
}  // namespace torch_pipeline
