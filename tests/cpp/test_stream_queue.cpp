// core::StreamQueue: the per-stream FIFO executor of the sim device's asynchronous mode.
#include "core/stream_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using torch_pipeline::core::StreamQueue;
using namespace std::chrono_literals;

TEST(StreamQueue, RunsInFifoOrderOnItsOwnThreadAndReturnsAtOnce) {
  StreamQueue q;
  std::vector<int> order;
  std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> other_thread{true};
  const auto start = std::chrono::steady_clock::now();
  uint64_t last = 0;
  for (int i = 0; i < 5; ++i) {
    last = q.enqueue(
        [&, i] {
          order.push_back(i);
          if (std::this_thread::get_id() == caller) other_thread = false;
        },
        10ms);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30ms);  // enqueue does not wait
  EXPECT_EQ(last, 5u);
  q.wait(last);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 50ms);  // each took its minimum duration
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_TRUE(other_thread);
  EXPECT_EQ(q.completed(), 5u);
}

TEST(StreamQueue, CompletedIsAPrefix) {
  StreamQueue q;
  std::atomic<bool> release{false};
  const uint64_t a = q.enqueue([&] {
    while (!release) std::this_thread::sleep_for(1ms);
  });
  const uint64_t b = q.enqueue([] {});
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(q.reached(a));
  EXPECT_FALSE(q.reached(b));
  release = true;
  q.drain();
  EXPECT_TRUE(q.reached(b));
}

TEST(StreamQueue, WaitEntryBlocksUntilTheOtherQueueReachesTheNumber) {
  StreamQueue producer, consumer;
  std::atomic<int> value{0};
  const uint64_t made = producer.enqueue([&] { value = 42; }, 40ms);
  consumer.enqueue_wait(producer, made);
  std::atomic<int> seen{-1};
  const uint64_t read = consumer.enqueue([&] { seen = value.load(); });
  consumer.wait(read);
  EXPECT_EQ(seen, 42);
  // Without the wait, the consumer runs before the slow producer.
  const uint64_t made2 = producer.enqueue([&] { value = 7; }, 40ms);
  const uint64_t read2 = consumer.enqueue([&] { seen = value.load(); });
  consumer.wait(read2);
  EXPECT_EQ(seen, 42);
  producer.wait(made2);
  EXPECT_EQ(value, 7);
}

TEST(StreamQueue, TwoQueuesOverlapInTime) {
  StreamQueue a, b;
  const auto start = std::chrono::steady_clock::now();
  const uint64_t sa = a.enqueue([] {}, 100ms);
  const uint64_t sb = b.enqueue([] {}, 100ms);
  a.wait(sa);
  b.wait(sb);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 180ms);
}

TEST(StreamQueue, ErrorsAreReportedAndTheQueueGoesOn) {
  std::mutex m;
  std::vector<std::string> errors;
  StreamQueue q(0, {}, [&](const std::string& msg) {
    std::lock_guard<std::mutex> lock(m);
    errors.push_back(msg);
  });
  std::atomic<bool> ran{false};
  q.enqueue([] { throw std::runtime_error("boom"); });
  q.wait(q.enqueue([&] { ran = true; }));
  EXPECT_TRUE(ran);
  std::lock_guard<std::mutex> lock(m);
  EXPECT_EQ(errors, (std::vector<std::string>{"boom"}));
}

TEST(StreamQueue, ShutdownDrainsJoinsAndALaterEnqueueRestarts) {
  StreamQueue q;
  std::atomic<int> n{0};
  for (int i = 0; i < 3; ++i) q.enqueue([&] { ++n; }, 5ms);
  q.shutdown();
  EXPECT_EQ(n, 3);
  EXPECT_FALSE(q.running());
  q.wait(q.enqueue([&] { ++n; }));
  EXPECT_EQ(n, 4);
  EXPECT_TRUE(q.running());
}

// An enqueue that lands after the thread left its loop (queue empty, stopping) but before
// shutdown() took the thread to join it: the entry must still run, on a new thread. (It was left
// queued with no thread to run it, and every wait for it hung: the sim's exit, which shuts the
// queues down while daemon threads still launch kernels.)
TEST(StreamQueue, AnEnqueueRacingShutdownStillRuns) {
  StreamQueue q;
  for (int i = 0; i < 10000; ++i) {
    q.wait(q.enqueue([] {}));
    std::thread stopper([&] { q.shutdown(); });
    const uint64_t seq = q.enqueue([] {});
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (!q.reached(seq) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(50us);
    }
    stopper.join();
    ASSERT_TRUE(q.reached(seq)) << "entry " << seq << " of round " << i
                                << " never ran: it was queued with no thread";
  }
}

TEST(StreamQueue, ABaseContinuesTheNumbering) {
  StreamQueue q(10);
  EXPECT_TRUE(q.reached(10));
  EXPECT_EQ(q.enqueue([] {}), 11u);
  q.drain();
}

TEST(StreamQueue, FinishedWorkIsDestroyedByACallerNotTheQueueThread) {
  StreamQueue q;
  std::atomic<bool> destroyed_on_queue_thread{false};
  std::thread::id caller = std::this_thread::get_id();
  struct Probe {
    std::atomic<bool>* flag;
    std::thread::id caller;
    ~Probe() {
      if (flag != nullptr && std::this_thread::get_id() != caller) *flag = true;
    }
  };
  {
    auto probe = std::make_shared<Probe>(Probe{&destroyed_on_queue_thread, caller});
    q.enqueue([p = std::move(probe)] {}, 20ms);
  }
  // Another queue waiting for q (an event wait) does not destroy q's finished work either.
  StreamQueue other;
  other.wait(other.enqueue_wait(q, q.enqueued()));
  std::this_thread::sleep_for(10ms);
  q.drain();
  q.shutdown();
  EXPECT_FALSE(destroyed_on_queue_thread);
}

TEST(StreamQueue, ManyProducersKeepPerProducerOrder) {
  StreamQueue q;
  std::mutex m;
  std::vector<std::vector<int>> seen(4);
  std::vector<std::thread> producers;
  for (int p = 0; p < 4; ++p) {
    producers.emplace_back([&, p] {
      for (int i = 0; i < 200; ++i) {
        q.enqueue([&, p, i] {
          std::lock_guard<std::mutex> lock(m);
          seen[static_cast<size_t>(p)].push_back(i);
        });
      }
    });
  }
  for (auto& t : producers) t.join();
  q.drain();
  for (const auto& s : seen) {
    ASSERT_EQ(s.size(), 200u);
    for (int i = 0; i < 200; ++i) EXPECT_EQ(s[static_cast<size_t>(i)], i);
  }
}
