#include "core/worker_pool.h"
#include "gate.h"

#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using namespace std::chrono_literals;
using torch_pipeline::core::Task;
using torch_pipeline::core::WorkerPool;
using torch_pipeline::core::WorkerThread;

using torch_pipeline::testing::Gate;
using torch_pipeline::testing::kLong;

// A Task built from two callables.
class FnTask : public Task {
 public:
  FnTask(std::function<void()> run, std::function<void(const std::string&)> cancel)
      : run_(std::move(run)), cancel_(std::move(cancel)) {}
  void run() override {
    if (run_) run_();
  }
  void cancel(const std::string& reason) noexcept override {
    if (cancel_) cancel_(reason);
  }

 private:
  std::function<void()> run_;
  std::function<void(const std::string&)> cancel_;
};

std::unique_ptr<Task> make_task(std::function<void()> run,
                                std::function<void(const std::string&)> cancel = {}) {
  return std::make_unique<FnTask>(std::move(run), std::move(cancel));
}

// A counter that can be waited on.
class Counter {
 public:
  void add(int n = 1) {
    std::lock_guard<std::mutex> lock(mutex_);
    value_ += n;
    cv_.notify_all();
  }
  int get() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return value_;
  }
  bool wait_for_at_least(int n, std::chrono::milliseconds timeout = kLong) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, timeout, [&] { return value_ >= n; });
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  int value_ = 0;
};

// Records what happened to a group of tasks.
struct Tally {
  std::atomic<int> ran{0};
  Counter cancelled;
  std::mutex mutex;
  std::vector<std::string> reasons;

  std::unique_ptr<Task> task() {
    return make_task([this] { ran.fetch_add(1); },
                     [this](const std::string& reason) {
                       {
                         std::lock_guard<std::mutex> lock(mutex);
                         reasons.push_back(reason);
                       }
                       cancelled.add();
                     });
  }
};

// A task that says when it has started and then blocks until released.
std::unique_ptr<Task> make_blocker(Gate& started, Gate& release,
                                   std::atomic<bool>* finished = nullptr) {
  return make_task([&started, &release, finished] {
    started.open();
    release.wait();
    if (finished != nullptr) finished->store(true);
  });
}

// ---------------------------------------------------------------------------------------------
// Ordering and sequence numbers

TEST(WorkerThread, RunsTasksFromOneProducerInFifoOrder) {
  constexpr int kTasks = 10000;
  WorkerThread w(0, {});
  std::vector<int> order;  // touched only on the worker until wait_until_done returns
  order.reserve(kTasks);
  uint64_t last = 0;
  for (int i = 0; i < kTasks; ++i) {
    const uint64_t seq = w.submit(make_task([&order, i] { order.push_back(i); }));
    ASSERT_EQ(seq, static_cast<uint64_t>(i) + 1);
    last = seq;
  }
  ASSERT_TRUE(w.wait_until_done(last, kLong));
  ASSERT_EQ(order.size(), static_cast<size_t>(kTasks));
  for (int i = 0; i < kTasks; ++i) ASSERT_EQ(order[static_cast<size_t>(i)], i) << "at " << i;
}

TEST(WorkerThread, ManyProducersEachTaskRunsOnceInPerProducerOrder) {
  constexpr int kProducers = 8;
  constexpr int kPerProducer = 2000;
  WorkerThread w(1, {});
  std::vector<std::pair<int, int>> runs;  // (producer, index), appended on the worker
  runs.reserve(kProducers * kPerProducer);
  std::vector<std::vector<uint64_t>> seqs(kProducers);

  Gate go;
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      go.wait();
      for (int i = 0; i < kPerProducer; ++i) {
        seqs[static_cast<size_t>(p)].push_back(
            w.submit(make_task([&runs, p, i] { runs.emplace_back(p, i); })));
      }
    });
  }
  go.open();
  for (auto& t : producers) t.join();

  constexpr uint64_t kTotal = kProducers * kPerProducer;
  EXPECT_EQ(w.submitted(), kTotal);
  ASSERT_TRUE(w.wait_until_done(kTotal, kLong));
  EXPECT_EQ(w.completed(), kTotal);

  ASSERT_EQ(runs.size(), static_cast<size_t>(kTotal));
  std::vector<int> next(kProducers, 0);
  for (const auto& r : runs) {
    // Each producer's tasks run once each, in the order it submitted them.
    ASSERT_EQ(r.second, next[static_cast<size_t>(r.first)]) << "producer " << r.first;
    ++next[static_cast<size_t>(r.first)];
  }
  for (int p = 0; p < kProducers; ++p) EXPECT_EQ(next[static_cast<size_t>(p)], kPerProducer);

  // Sequence numbers are unique and increase within a producer.
  std::vector<bool> seen(kTotal + 1, false);
  for (const auto& s : seqs) {
    for (size_t i = 0; i < s.size(); ++i) {
      ASSERT_GE(s[i], 1u);
      ASSERT_LE(s[i], kTotal);
      ASSERT_FALSE(seen[s[i]]) << "sequence number " << s[i] << " given twice";
      seen[s[i]] = true;
      if (i > 0) {
        ASSERT_GT(s[i], s[i - 1]);
      }
    }
  }
}

TEST(WorkerThread, SequenceNumbersAndWaitUntilDone) {
  WorkerThread w(0, {});
  EXPECT_EQ(w.submitted(), 0u);
  EXPECT_EQ(w.completed(), 0u);
  EXPECT_TRUE(w.wait_until_done(0, 0ms));  // nothing to wait for

  Gate started, release;
  std::atomic<bool> first_done{false};
  auto owned = std::make_shared<int>(42);
  std::weak_ptr<int> watch = owned;
  EXPECT_EQ(w.submit(make_blocker(started, release, &first_done)), 1u);
  std::atomic<int> second_ran{0};
  EXPECT_EQ(w.submit(make_task([&second_ran, owned] { second_ran.fetch_add(*owned - 41); })), 2u);
  owned.reset();
  EXPECT_EQ(w.submitted(), 2u);

  ASSERT_TRUE(started.wait());
  EXPECT_TRUE(w.busy());
  EXPECT_EQ(w.completed(), 0u);
  EXPECT_FALSE(w.wait_until_done(1, 0ms));

  release.open();
  ASSERT_TRUE(w.wait_until_done(2, kLong));
  // Done means run() returned and the task (and what it owned) is gone.
  EXPECT_TRUE(first_done.load());
  EXPECT_EQ(second_ran.load(), 1);
  EXPECT_TRUE(watch.expired());
  EXPECT_EQ(w.completed(), 2u);
  EXPECT_TRUE(w.wait_until_done(1, 0ms));
}

TEST(WorkerThread, WaitUntilDoneTimesOutWhileATaskBlocks) {
  WorkerThread w(0, {});
  Gate started, release;
  const uint64_t seq = w.submit(make_blocker(started, release));
  ASSERT_TRUE(started.wait());

  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(w.wait_until_done(seq, 100ms));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 100ms);
  // A number not handed out yet just waits (and times out) too.
  EXPECT_FALSE(w.wait_until_done(seq + 5, 20ms));

  release.open();
  EXPECT_TRUE(w.wait_until_done(seq, kLong));
  EXPECT_FALSE(w.wait_until_done(seq + 5, 20ms));
}

TEST(WorkerThread, WaitUntilDoneWithHugeTimeoutWaitsForever) {
  // milliseconds::max() must mean "no deadline", not overflow into "already expired".
  WorkerThread w(0, {});
  Gate started, release;
  const uint64_t seq = w.submit(make_blocker(started, release));
  ASSERT_TRUE(started.wait());
  std::thread releaser([&] {
    std::this_thread::sleep_for(50ms);
    release.open();
  });
  EXPECT_TRUE(w.wait_until_done(seq, std::chrono::milliseconds::max()));
  EXPECT_TRUE(release.is_open());
  releaser.join();
}

// ---------------------------------------------------------------------------------------------
// on_idle

TEST(WorkerThread, OnIdleRunsOnWorkerOnlyOnceTheQueueHasDrained) {
  constexpr int kId = 3;
  constexpr int kQueued = 100;
  std::atomic<WorkerThread*> self{nullptr};
  Counter idle_calls;
  std::atomic<int> idle_on_wrong_thread{0};
  std::atomic<int> idle_with_work_left{0};

  WorkerThread w(kId, [&] {
    WorkerThread* me = self.load();
    if (WorkerThread::current_id() != kId || !me->is_current_thread()) {
      idle_on_wrong_thread.fetch_add(1);
    }
    // These take the worker's mutex: if on_idle were called with it held, this would deadlock.
    if (me->busy() || me->completed() != me->submitted()) idle_with_work_left.fetch_add(1);
    idle_calls.add();
  });
  self.store(&w);

  // Each task records how many on_idle calls happened before it ran.
  std::vector<int> idle_seen_by_task;  // appended on the worker only
  auto recording_task = [&] {
    return make_task([&] { idle_seen_by_task.push_back(idle_calls.get()); });
  };

  Gate started, release;
  w.submit(make_task([&] {
    idle_seen_by_task.push_back(idle_calls.get());
    started.open();
    release.wait();
  }));
  ASSERT_TRUE(started.wait());
  uint64_t last = 0;
  for (int i = 0; i < kQueued; ++i) last = w.submit(recording_task());
  release.open();

  ASSERT_TRUE(w.wait_until_done(last, kLong));
  ASSERT_TRUE(idle_calls.wait_for_at_least(1));
  std::this_thread::sleep_for(50ms);  // room for any extra (wrong) call to show up
  EXPECT_EQ(idle_calls.get(), 1);
  ASSERT_EQ(idle_seen_by_task.size(), static_cast<size_t>(kQueued + 1));
  for (size_t i = 0; i < idle_seen_by_task.size(); ++i) {
    EXPECT_EQ(idle_seen_by_task[i], 0)
        << "on_idle was called before task " << i << " while it was still queued";
  }

  // A second batch gets its own on_idle once it is done.
  last = w.submit(recording_task());
  ASSERT_TRUE(w.wait_until_done(last, kLong));
  ASSERT_TRUE(idle_calls.wait_for_at_least(2));
  EXPECT_EQ(idle_seen_by_task.back(), 1);

  EXPECT_EQ(idle_on_wrong_thread.load(), 0);
  EXPECT_EQ(idle_with_work_left.load(), 0);
}

TEST(WorkerThread, OnIdleIsCalledBeforeTheThreadExits) {
  // The Python layer keeps the GIL across a batch and drops it in on_idle: a worker that shuts
  // down after a batch must still call it.
  Counter idle_calls;
  Gate started, release;
  {
    WorkerThread w(0, [&] { idle_calls.add(); });
    w.submit(make_blocker(started, release));
    w.submit(make_task([] {}));
    ASSERT_TRUE(started.wait());
    std::thread stopper([&] { w.shutdown(/*cancel_queued=*/false); });
    // Release the blocker only once submits are refused, i.e. the shutdown has begun: the worker
    // then finds the queue empty with stopping set and must call on_idle before it exits.
    for (;;) {
      try {
        w.submit(make_task([] {}));
      } catch (const std::runtime_error&) {
        break;
      }
      std::this_thread::yield();
    }
    EXPECT_EQ(idle_calls.get(), 0);
    release.open();
    stopper.join();
    EXPECT_EQ(idle_calls.get(), 1);
  }
  EXPECT_EQ(idle_calls.get(), 1);
}

// ---------------------------------------------------------------------------------------------
// Cancelling and shutting down

TEST(WorkerThread, CancelPendingCancelsQueuedTasksButNotTheRunningOne) {
  WorkerThread w(0, {});
  Gate started, release;
  std::atomic<bool> blocker_finished{false};
  w.submit(make_blocker(started, release, &blocker_finished));
  ASSERT_TRUE(started.wait());

  Tally tally;
  uint64_t last = 0;
  for (int i = 0; i < 5; ++i) last = w.submit(tally.task());
  EXPECT_EQ(last, 6u);

  EXPECT_EQ(w.cancel_pending("pipeline closed"), 5u);
  EXPECT_EQ(tally.cancelled.get(), 5);
  EXPECT_EQ(tally.ran.load(), 0);
  for (const auto& r : tally.reasons) EXPECT_EQ(r, "pipeline closed");

  // The running task goes on, and the cancelled ones do not count as done before it: every number
  // <= completed() must be done.
  EXPECT_TRUE(w.busy());
  EXPECT_EQ(w.completed(), 0u);
  EXPECT_FALSE(w.wait_until_done(2, 0ms));
  EXPECT_FALSE(blocker_finished.load());

  release.open();
  ASSERT_TRUE(w.wait_until_done(last, kLong));
  EXPECT_TRUE(blocker_finished.load());
  EXPECT_EQ(w.completed(), 6u);
  EXPECT_EQ(tally.ran.load(), 0);

  // Nothing queued: nothing to cancel. The worker is still usable.
  EXPECT_EQ(w.cancel_pending("again"), 0u);
  last = w.submit(tally.task());
  ASSERT_TRUE(w.wait_until_done(last, kLong));
  EXPECT_EQ(tally.ran.load(), 1);
  EXPECT_EQ(tally.cancelled.get(), 5);
}

TEST(WorkerThread, PendingCountsQueuedTasksThatHaveNotStarted) {
  WorkerThread w(0, {});
  EXPECT_EQ(w.pending(), 0u);
  Gate started, release;
  w.submit(make_blocker(started, release, nullptr));
  ASSERT_TRUE(started.wait());
  EXPECT_EQ(w.pending(), 0u);  // the running task is not pending
  Tally tally;
  uint64_t last = 0;
  for (int i = 0; i < 3; ++i) last = w.submit(tally.task());
  EXPECT_EQ(w.pending(), 3u);
  release.open();
  ASSERT_TRUE(w.wait_until_done(last, kLong));
  EXPECT_EQ(w.pending(), 0u);
}

TEST(WorkerThread, CancelPendingFromInsideATask) {
  WorkerThread w(0, {});
  Gate started, release;
  std::atomic<uint64_t> completed_inside{99};
  std::atomic<size_t> cancelled_inside{0};
  w.submit(make_task([&] {
    started.open();
    release.wait();
    cancelled_inside.store(w.cancel_pending("from inside"));
    completed_inside.store(w.completed());
  }));
  ASSERT_TRUE(started.wait());
  Tally tally;
  uint64_t last = 0;
  for (int i = 0; i < 4; ++i) last = w.submit(tally.task());
  release.open();
  ASSERT_TRUE(w.wait_until_done(last, kLong));
  EXPECT_EQ(cancelled_inside.load(), 4u);
  EXPECT_EQ(completed_inside.load(), 0u);  // the cancelling task itself was still running
  EXPECT_EQ(tally.cancelled.get(), 4);
  EXPECT_EQ(tally.ran.load(), 0);
  EXPECT_EQ(w.completed(), 5u);
}

TEST(WorkerThread, ShutdownWithoutCancelDrainsTheQueue) {
  WorkerThread w(0, {});
  Gate started, release;
  w.submit(make_blocker(started, release));
  ASSERT_TRUE(started.wait());
  Tally tally;
  for (int i = 0; i < 50; ++i) w.submit(tally.task());

  std::thread stopper([&] { w.shutdown(/*cancel_queued=*/false); });
  // Probe until submits are refused, so the shutdown is known to have begun while tasks were
  // still queued; then let the blocker go.
  Tally probes;
  for (;;) {
    try {
      w.submit(probes.task());
    } catch (const std::runtime_error&) {
      break;
    }
    std::this_thread::yield();
  }
  release.open();
  stopper.join();

  EXPECT_EQ(tally.ran.load(), 50);
  EXPECT_EQ(tally.cancelled.get(), 0);
  EXPECT_EQ(probes.cancelled.get(), 1);  // only the refused probe
  EXPECT_EQ(w.completed(), w.submitted());
  EXPECT_EQ(static_cast<uint64_t>(probes.ran.load()), w.submitted() - 51);
}

TEST(WorkerThread, ShutdownWithCancelCancelsTheQueue) {
  WorkerThread w(0, {});
  Gate started, release;
  std::atomic<bool> blocker_finished{false};
  w.submit(make_blocker(started, release, &blocker_finished));
  ASSERT_TRUE(started.wait());
  Tally tally;
  for (int i = 0; i < 50; ++i) w.submit(tally.task());

  std::thread stopper([&] { w.shutdown(/*cancel_queued=*/true); });
  // The queued tasks are cancelled before the join, while the blocker still runs.
  ASSERT_TRUE(tally.cancelled.wait_for_at_least(50));
  EXPECT_FALSE(blocker_finished.load());
  release.open();
  stopper.join();

  EXPECT_TRUE(blocker_finished.load());  // the running task was let finish
  EXPECT_EQ(tally.ran.load(), 0);
  EXPECT_EQ(tally.cancelled.get(), 50);
  for (const auto& r : tally.reasons) EXPECT_NE(r.find("shut down"), std::string::npos) << r;
  EXPECT_EQ(w.completed(), 51u);
}

TEST(WorkerThread, SubmitAfterShutdownThrows) {
  WorkerThread w(7, {});
  w.submit(make_task([] {}));
  w.shutdown(false);
  w.shutdown(false);  // idempotent
  w.shutdown(true);

  Tally tally;
  try {
    w.submit(tally.task());
    ADD_FAILURE() << "submit after shutdown did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "torch_pipeline: worker thread 7 is shut down");
  }
  // Exactly one of run()/cancel() is called, even for a refused task.
  EXPECT_EQ(tally.ran.load(), 0);
  EXPECT_EQ(tally.cancelled.get(), 1);
  EXPECT_EQ(w.submitted(), 1u);
}

TEST(WorkerThread, ShutdownOfANeverStartedWorker) {
  WorkerThread w(0, {});
  w.shutdown(false);
  EXPECT_FALSE(w.started());
  EXPECT_THROW(w.submit(make_task([] {})), std::runtime_error);
  EXPECT_FALSE(w.started());
}

// Counts live instances, to check every task object is destroyed.
class TrackedTask : public Task {
 public:
  TrackedTask(std::atomic<int>& live, Tally& tally) : live_(live), tally_(tally) {
    live_.fetch_add(1);
    payload_.resize(1024);  // something for LeakSanitizer to notice
  }
  ~TrackedTask() override { live_.fetch_sub(1); }
  void run() override { tally_.ran.fetch_add(1); }
  void cancel(const std::string&) noexcept override { tally_.cancelled.add(); }

 private:
  std::atomic<int>& live_;
  Tally& tally_;
  std::vector<char> payload_;
};

TEST(WorkerThread, DestructorWithQueuedTasksCancelsThemAndDoesNotHang) {
  std::atomic<int> live{0};
  Tally tally;
  Gate started, release;
  auto* w = new WorkerThread(0, {});
  w->submit(make_blocker(started, release));
  ASSERT_TRUE(started.wait());
  for (int i = 0; i < 100; ++i) w->submit(std::make_unique<TrackedTask>(live, tally));
  EXPECT_EQ(live.load(), 100);

  std::thread destroyer([w] { delete w; });
  // The destructor cancels the queue before joining the (still blocked) thread.
  ASSERT_TRUE(tally.cancelled.wait_for_at_least(100));
  release.open();
  destroyer.join();

  EXPECT_EQ(tally.cancelled.get(), 100);
  EXPECT_EQ(tally.ran.load(), 0);
  EXPECT_EQ(live.load(), 0);
}

TEST(WorkerThread, DestructorOfIdleAndNeverStartedWorkers) {
  {
    WorkerThread never_started(0, {});
  }
  {
    WorkerThread idle(1, {});
    ASSERT_TRUE(idle.wait_until_done(idle.submit(make_task([] {})), kLong));
  }
  SUCCEED();
}

TEST(WorkerThread, ExceptionInATaskIsReportedAndTheNextTaskRuns) {
  WorkerThread w(2, {});
  std::atomic<bool> next_ran{false};
  testing::internal::CaptureStderr();
  w.submit(make_task([] { throw std::runtime_error("boom"); }));
  const uint64_t last = w.submit(make_task([&] { next_ran.store(true); }));
  const bool done = w.wait_until_done(last, kLong);
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(done);
  EXPECT_TRUE(next_ran.load());
  EXPECT_EQ(w.completed(), 2u);
  EXPECT_NE(err.find("torch_pipeline: worker thread 2: task raised: boom"), std::string::npos)
      << err;
}

#if defined(__GLIBC__)
TEST(WorkerThread, ForcedUnwindPassesThroughTheWorkerLoop) {
  // pthread_exit() (which CPython calls on threads that touch the GIL during finalization) unwinds
  // with a forced-unwind exception. The worker loop must let it through: a `catch (...)` that does
  // not rethrow makes glibc abort the whole process ("FATAL: exception not rethrown").
  struct SetOnUnwind {
    std::atomic<bool>& flag;
    ~SetOnUnwind() { flag.store(true); }
  };
  std::atomic<bool> unwound{false};
  Tally tally;
  {
    WorkerThread w(0, {});
    Gate started, release;
    w.submit(make_task([&] {
      SetOnUnwind on_unwind{unwound};
      started.open();
      release.wait();
      pthread_exit(nullptr);
    }));
    w.submit(tally.task());
    ASSERT_TRUE(started.wait());
    release.open();
    // The thread is gone and the second task never runs; the destructor cancels it and joins.
  }
  EXPECT_TRUE(unwound.load());
  EXPECT_EQ(tally.ran.load(), 0);
  EXPECT_EQ(tally.cancelled.get(), 1);
}
#endif

TEST(WorkerThread, ShutdownFromInsideATaskDoesNotDeadlock) {
  for (bool cancel_queued : {false, true}) {
    SCOPED_TRACE(cancel_queued ? "cancel_queued" : "drain");
    Tally tally;
    Gate release;
    std::atomic<bool> returned{false};
    {
      WorkerThread w(0, {});
      w.submit(make_task([&] {
        release.wait();
        w.shutdown(cancel_queued);
        returned.store(true);
      }));
      const uint64_t last = w.submit(tally.task());
      release.open();
      ASSERT_TRUE(w.wait_until_done(last, kLong));
      EXPECT_TRUE(returned.load());
      EXPECT_EQ(tally.ran.load(), cancel_queued ? 0 : 1);
      EXPECT_EQ(tally.cancelled.get(), cancel_queued ? 1 : 0);
      EXPECT_THROW(w.submit(make_task([] {})), std::runtime_error);
      // Leaving the scope destroys w from this thread, which joins the worker thread.
    }
  }
}

TEST(WorkerThread, SubmitConcurrentWithShutdown) {
  WorkerThread w(0, {});
  std::atomic<int> accepted{0};
  Tally tally;
  Tally refused;
  std::vector<std::thread> producers;
  for (int p = 0; p < 4; ++p) {
    producers.emplace_back([&] {
      for (;;) {
        // Cancellations go to `refused`: only a refused submit may cancel (the queue drains).
        auto task = make_task([&tally] { tally.ran.fetch_add(1); },
                              [&refused](const std::string&) { refused.cancelled.add(); });
        try {
          w.submit(std::move(task));
          accepted.fetch_add(1);
        } catch (const std::runtime_error&) {
          return;
        }
      }
    });
  }
  while (accepted.load() < 2000) std::this_thread::yield();
  w.shutdown(/*cancel_queued=*/false);
  for (auto& t : producers) t.join();

  EXPECT_EQ(static_cast<uint64_t>(accepted.load()), w.submitted());
  EXPECT_EQ(tally.ran.load(), accepted.load());  // drained: every accepted task ran once
  EXPECT_EQ(refused.cancelled.get(), 4);         // one refused submit per producer
  EXPECT_EQ(w.completed(), w.submitted());
}

TEST(WorkerThread, ConcurrentShutdownsAllWaitForTheDrain) {
  WorkerThread w(0, {});
  Gate started, release;
  w.submit(make_blocker(started, release));
  ASSERT_TRUE(started.wait());
  Tally tally;
  for (int i = 0; i < 200; ++i) w.submit(tally.task());

  std::atomic<int> returned_early{0};
  std::vector<std::thread> stoppers;
  for (int i = 0; i < 4; ++i) {
    stoppers.emplace_back([&] {
      w.shutdown(/*cancel_queued=*/false);
      if (w.completed() != w.submitted() || w.busy()) returned_early.fetch_add(1);
    });
  }
  std::this_thread::sleep_for(20ms);
  release.open();
  for (auto& t : stoppers) t.join();

  EXPECT_EQ(returned_early.load(), 0);
  EXPECT_EQ(tally.ran.load(), 200);
  EXPECT_EQ(w.completed(), 201u);
}

// ---------------------------------------------------------------------------------------------
// Thread identity and lazy start

TEST(WorkerThread, CurrentIdAndIsCurrentThread) {
  WorkerThread a(5, {});
  WorkerThread b(6, {});
  EXPECT_EQ(WorkerThread::current_id(), -1);
  EXPECT_FALSE(a.is_current_thread());

  std::atomic<int> id_in_a{-100}, id_in_b{-100};
  std::atomic<bool> a_is_current{false}, b_is_current_in_a{true};
  const uint64_t seq_a = a.submit(make_task([&] {
    id_in_a.store(WorkerThread::current_id());
    a_is_current.store(a.is_current_thread());
    b_is_current_in_a.store(b.is_current_thread());
  }));
  const uint64_t seq_b = b.submit(make_task([&] { id_in_b.store(WorkerThread::current_id()); }));
  ASSERT_TRUE(a.wait_until_done(seq_a, kLong));
  ASSERT_TRUE(b.wait_until_done(seq_b, kLong));

  EXPECT_EQ(id_in_a.load(), 5);
  EXPECT_EQ(id_in_b.load(), 6);
  EXPECT_TRUE(a_is_current.load());
  EXPECT_FALSE(b_is_current_in_a.load());
  EXPECT_EQ(WorkerThread::current_id(), -1);
  EXPECT_FALSE(a.is_current_thread());
  EXPECT_EQ(a.id(), 5);
}

TEST(WorkerThread, ThreadStartsLazilyOnFirstSubmit) {
  WorkerThread w(0, {});
  EXPECT_FALSE(w.started());
  EXPECT_FALSE(w.busy());
  EXPECT_EQ(w.cancel_pending("nothing"), 0u);
  EXPECT_FALSE(w.started());
  ASSERT_TRUE(w.wait_until_done(w.submit(make_task([] {})), kLong));
  EXPECT_TRUE(w.started());
  EXPECT_FALSE(w.busy());
}

// ---------------------------------------------------------------------------------------------
// WorkerPool

TEST(WorkerPool, RejectsCapBelowOne) {
  EXPECT_THROW(WorkerPool(0, {}), std::invalid_argument);
  EXPECT_THROW(WorkerPool(-2, {}), std::invalid_argument);
  WorkerPool one(1, {});
  EXPECT_EQ(one.cap(), 1);
  EXPECT_NO_THROW(one.worker(0));
  EXPECT_THROW(one.worker(1), std::out_of_range);
}

TEST(WorkerPool, OutOfRangeIdNamesTheCap) {
  WorkerPool pool(4, {});
  EXPECT_EQ(pool.cap(), 4);
  for (int bad : {4, 7, -1}) {
    try {
      pool.worker(bad);
      ADD_FAILURE() << "worker(" << bad << ") did not throw";
    } catch (const std::out_of_range& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("worker thread id " + std::to_string(bad) + " is out of range"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("the pool has 4 worker threads (ids 0..3)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("set_max_worker_threads"), std::string::npos) << msg;
      EXPECT_NE(msg.find("TORCH_PIPELINE_MAX_WORKER_THREADS"), std::string::npos) << msg;
    }
  }
  EXPECT_TRUE(pool.created().empty());  // failed lookups create nothing
}

TEST(WorkerPool, CreatesWorkersLazilyAndStartsThemOnSubmit) {
  std::atomic<int> idle_calls{0};
  WorkerPool pool(4, [&] { idle_calls.fetch_add(1); });
  EXPECT_TRUE(pool.created().empty());

  WorkerThread& w2 = pool.worker(2);
  EXPECT_EQ(&pool.worker(2), &w2);  // same object every time
  EXPECT_EQ(w2.id(), 2);
  EXPECT_FALSE(w2.started());
  WorkerThread& w0 = pool.worker(0);

  const std::vector<WorkerThread*> created = pool.created();
  ASSERT_EQ(created.size(), 2u);
  EXPECT_EQ(created[0], &w0);
  EXPECT_EQ(created[1], &w2);

  std::atomic<int> id_seen{-1};
  ASSERT_TRUE(w2.wait_until_done(
      w2.submit(make_task([&] { id_seen.store(WorkerThread::current_id()); })), kLong));
  EXPECT_TRUE(w2.started());
  EXPECT_FALSE(w0.started());
  EXPECT_EQ(id_seen.load(), 2);

  // The pool's on_idle is handed to its workers.
  pool.shutdown(false);
  EXPECT_EQ(idle_calls.load(), 1);
  EXPECT_THROW(w2.submit(make_task([] {})), std::runtime_error);
  EXPECT_THROW(w0.submit(make_task([] {})), std::runtime_error);
}

TEST(WorkerPool, DestructorCancelsQueuedTasksOnEveryWorker) {
  Tally tally;
  Gate started0, started1, release;
  auto* pool = new WorkerPool(3, {});
  pool->worker(0).submit(make_blocker(started0, release));
  pool->worker(1).submit(make_blocker(started1, release));
  ASSERT_TRUE(started0.wait());
  ASSERT_TRUE(started1.wait());
  for (int i = 0; i < 10; ++i) {
    pool->worker(0).submit(tally.task());
    pool->worker(1).submit(tally.task());
  }
  pool->worker(2);  // created, never started

  std::thread destroyer([pool] { delete pool; });
  // Every queue is cancelled before any worker is joined (worker 0 blocks its join until release).
  ASSERT_TRUE(tally.cancelled.wait_for_at_least(20));
  release.open();
  destroyer.join();
  EXPECT_EQ(tally.cancelled.get(), 20);
  EXPECT_EQ(tally.ran.load(), 0);
}

TEST(WorkerPool, ShutdownFromInsideAWorkerTask) {
  Tally tally;
  Gate release;
  std::atomic<bool> returned{false};
  {
    WorkerPool pool(2, {});
    pool.worker(1).submit(tally.task());
    pool.worker(0).submit(make_task([&] {
      release.wait();
      pool.shutdown(/*cancel_queued=*/false);
      returned.store(true);
    }));
    const uint64_t last = pool.worker(0).submit(tally.task());
    release.open();
    ASSERT_TRUE(pool.worker(0).wait_until_done(last, kLong));
    EXPECT_TRUE(returned.load());
    EXPECT_EQ(tally.ran.load(), 2);
    EXPECT_THROW(pool.worker(1).submit(make_task([] {})), std::runtime_error);
  }
  EXPECT_EQ(tally.cancelled.get(), 0);
}

}  // namespace
