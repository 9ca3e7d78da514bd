// WorkerPool::begin_wait: waits of tasks for tasks of other worker threads, and the cycles among
// them that could never end (each worker runs its tasks one at a time, in order).
#include "core/worker_pool.h"
#include "gate.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

namespace {

using torch_pipeline::core::Task;
using torch_pipeline::core::WaitCycleError;
using torch_pipeline::core::WorkerPool;

using torch_pipeline::testing::Gate;
using torch_pipeline::testing::kLong;

class NamedTask : public Task {
 public:
  NamedTask(std::string name, std::function<void()> run)
      : name_(std::move(name)), run_(std::move(run)) {}
  void run() override {
    if (run_) run_();
  }
  void cancel(const std::string&) noexcept override {}
  std::string describe() const override { return name_; }

 private:
  std::string name_;
  std::function<void()> run_;
};

std::unique_ptr<Task> named(std::string name, std::function<void()> run = {}) {
  return std::make_unique<NamedTask>(std::move(name), std::move(run));
}

// What a task does when it waits for (target, seq): registers, then blocks until done.
bool wait_for(WorkerPool& pool, int self, int target, uint64_t seq) {
  auto guard = pool.begin_wait(self, target, seq);
  return pool.worker(target).wait_until_done(seq, kLong);
}

TEST(WaitCycles, TaskQueuedBehindTheWaiterAcrossTwoWorkersRaisesNamingBothTasks) {
  Gate a_started, b_registered, seqs_known;
  std::optional<std::string> a_error, b_error;
  uint64_t c_seq = 0, b_seq = 0;
  WorkerPool pool(3, {});  // declared last: destroyed (workers joined) first
  // A on worker 1 waits for B on worker 2, which waits for C, queued behind A on worker 1.
  pool.worker(1).submit(named("task A of pipeline p1", [&] {
    seqs_known.wait();
    a_started.open();
    b_registered.wait();  // B registers first, so A closes the cycle
    try {
      wait_for(pool, 1, 2, b_seq);
    } catch (const WaitCycleError& e) {
      a_error = e.what();
    }
  }));
  c_seq = pool.worker(1).submit(named("task C of pipeline p1b"));
  b_seq = pool.worker(2).submit(named("task B of pipeline p2", [&] {
    a_started.wait();
    auto guard = pool.begin_wait(2, 1, c_seq);
    b_registered.open();
    if (!pool.worker(1).wait_until_done(c_seq, kLong)) b_error = "timed out";
  }));
  seqs_known.open();
  ASSERT_TRUE(pool.worker(1).wait_until_done(c_seq, kLong));
  ASSERT_TRUE(pool.worker(2).wait_until_done(b_seq, kLong));
  ASSERT_TRUE(a_error.has_value()) << "the cycle was not detected";
  EXPECT_FALSE(b_error.has_value());
  const std::string& m = *a_error;
  EXPECT_NE(m.find("cycle"), std::string::npos) << m;
  EXPECT_NE(m.find("task A of pipeline p1 on worker thread 1 (its task #1) waits for task B of "
                   "pipeline p2 on worker thread 2 (its task #1)"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("task B of pipeline p2 on worker thread 2 (its task #1) waits for task C of "
                   "pipeline p1b on worker thread 1 (its task #2)"),
            std::string::npos)
      << m;
}

TEST(WaitCycles, ThreeWorkerCycleIsDetected) {
  // Registrations only (no blocking): 1 waits for 2's task, 2 for 3's, 3 for one behind 1's.
  Gate hold1, hold2, hold3;
  WorkerPool pool(4, {});
  const uint64_t s1 = pool.worker(1).submit(named("t1", [&] { hold1.wait(); }));
  const uint64_t s1b = pool.worker(1).submit(named("t1b"));
  const uint64_t s2 = pool.worker(2).submit(named("t2", [&] { hold2.wait(); }));
  const uint64_t s3 = pool.worker(3).submit(named("t3", [&] { hold3.wait(); }));
  (void)s1;
  auto g1 = pool.begin_wait(1, 2, s2);
  auto g2 = pool.begin_wait(2, 3, s3);
  try {
    auto g3 = pool.begin_wait(3, 1, s1b);
    FAIL() << "expected a WaitCycleError";
  } catch (const WaitCycleError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("t3 on worker thread 3 (its task #1) waits for t1b on worker thread 1 (its "
                     "task #2)"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("t1 on worker thread 1 (its task #1) waits for t2 on"), std::string::npos)
        << m;
    EXPECT_NE(m.find("t2 on worker thread 2 (its task #1) waits for t3 on"), std::string::npos)
        << m;
  }
  hold1.open();
  hold2.open();
  hold3.open();
  ASSERT_TRUE(pool.worker(1).wait_until_done(s1b, kLong));
}

TEST(WaitCycles, ChainsWithoutCycleAndEndedWaitsAreAllowed) {
  Gate hold2, hold3;
  WorkerPool pool(4, {});
  const uint64_t s2 = pool.worker(2).submit(named("t2", [&] { hold2.wait(); }));
  const uint64_t s3 = pool.worker(3).submit(named("t3", [&] { hold3.wait(); }));
  pool.worker(1).submit(named("t1", [] {}));
  ASSERT_TRUE(pool.worker(1).wait_until_done(1, kLong));
  const uint64_t s1 = pool.worker(1).submit(named("t1 again"));
  ASSERT_TRUE(pool.worker(1).wait_until_done(s1, kLong));
  {
    auto g2 = pool.begin_wait(2, 3, s3);  // 2 waits for 3: a chain
    auto g1 = pool.begin_wait(1, 2, s2);  // 1 waits for 2 (which waits for 3): still a chain
    // 3 waiting for a task of 1 that is already done is no cycle either.
    auto g3 = pool.begin_wait(3, 1, s1);
  }
  {
    auto g1 = pool.begin_wait(1, 2, s2);
    // While 1 waits for 2, 2 waiting for 1's next task is a cycle...
    EXPECT_THROW({ auto g = pool.begin_wait(2, 1, s1 + 1); }, WaitCycleError);
  }
  // ... and no longer once 1's wait has ended (its guard is gone).
  EXPECT_NO_THROW({ auto g = pool.begin_wait(2, 1, s1 + 1); });
  hold2.open();
  hold3.open();
  ASSERT_TRUE(pool.worker(3).wait_until_done(s3, kLong));
}

TEST(WaitCycles, RacingRegistrationsNeverBothPass) {
  // Two tasks closing the same cycle at once: exactly one gets the error, so nothing hangs.
  for (int round = 0; round < 50; ++round) {
    Gate go, seqs;
    std::mutex mutex;
    int errors = 0;
    uint64_t a2 = 0, b2 = 0;
    WorkerPool pool(3, {});
    auto waiter = [&](int self, int other, const uint64_t* seq) {
      return [&, self, other, seq] {
        seqs.wait();
        go.wait();
        try {
          wait_for(pool, self, other, *seq);
        } catch (const WaitCycleError&) {
          std::lock_guard<std::mutex> lock(mutex);
          ++errors;
        }
      };
    };
    pool.worker(1).submit(named("a1", waiter(1, 2, &b2)));
    a2 = pool.worker(1).submit(named("a2"));
    pool.worker(2).submit(named("b1", waiter(2, 1, &a2)));
    b2 = pool.worker(2).submit(named("b2"));
    seqs.open();
    go.open();
    ASSERT_TRUE(pool.worker(1).wait_until_done(a2, kLong)) << "round " << round;
    ASSERT_TRUE(pool.worker(2).wait_until_done(b2, kLong)) << "round " << round;
    EXPECT_EQ(errors, 1) << "round " << round;
  }
}

}  // namespace
