// Graph capture as the tracker sees it (core/capture_state.h), each piece driven the way the
// runtime (csrc/runtime/tracking/graph_capture.cpp) uses it: the query gate with its permits (the
// keep-alive poll's try_permit under a lock, the host wait's permit, a capture's begin pausing and
// draining), the route of a launch, the ledger over a DependencyTracker's positions (forks, joins,
// what is kept for the graph's lifetime), and the registry of captures that holds the gate paused.
#include "core/capture_state.h"
#include "core/dependency_tracker.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

using torch_pipeline::core::CaptureId;
using torch_pipeline::core::CaptureLedger;
using torch_pipeline::core::CaptureRegistry;
using torch_pipeline::core::CaptureRoute;
using torch_pipeline::core::DependencyTracker;
using torch_pipeline::core::kNoCapture;
using torch_pipeline::core::kUnknownCapture;
using torch_pipeline::core::Position;
using torch_pipeline::core::QueryGate;
using torch_pipeline::core::QueryPause;
using torch_pipeline::core::route_launch;
using torch_pipeline::core::StreamId;

namespace {

using Item = std::shared_ptr<int>;
using Ledger = CaptureLedger<Item, std::weak_ptr<int>>;

// The runtime's calls, with an int standing in for a storage (key: its address).
uintptr_t key(const Item& item) { return reinterpret_cast<uintptr_t>(item.get()); }
bool use(Ledger& ledger, const Item& item, StreamId on, bool write) {
  return ledger.use(
      key(item), on, write, [&] { return std::weak_ptr<int>(item); }, [&] { return item; });
}
bool born(Ledger& ledger, const Item& item, StreamId home, bool keep = false) {
  return ledger.born(
      key(item), home, keep, [&] { return std::weak_ptr<int>(item); }, [&] { return item; });
}

}  // namespace

TEST(CaptureRoute, FromThreadAndStreamCapture) {
  EXPECT_EQ(route_launch(kNoCapture, kNoCapture), CaptureRoute::kEager);
  EXPECT_EQ(route_launch(7, kNoCapture), CaptureRoute::kFork);
  EXPECT_EQ(route_launch(7, 7), CaptureRoute::kCaptured);
  EXPECT_EQ(route_launch(kNoCapture, 7), CaptureRoute::kCaptured);       // another thread's capture
  EXPECT_EQ(route_launch(7, kUnknownCapture), CaptureRoute::kCaptured);  // invalidated
  EXPECT_EQ(route_launch(7, 8), CaptureRoute::kMixed);
}

TEST(QueryGate, PausesNestAndPermitsFollowThem) {
  QueryGate gate;
  EXPECT_TRUE(gate.may_query());
  EXPECT_TRUE(gate.permit());
  EXPECT_TRUE(gate.try_permit());
  gate.pause();
  gate.pause();
  EXPECT_FALSE(gate.may_query());
  EXPECT_FALSE(gate.permit());      // (a host wait skips)
  EXPECT_FALSE(gate.try_permit());  // (a poll skips)
  gate.resume();
  EXPECT_FALSE(gate.permit());
  EXPECT_EQ(gate.paused(), 1);
  gate.resume();
  EXPECT_TRUE(gate.permit());
}

// In a forked child the gate opens again (no capture survives fork). The reset leaks the lock a
// parent's thread may hold, on purpose: it runs in a child, which _exits without a leak check.
TEST(QueryGate, ResetAfterForkOpensTheGate) {
  QueryGate gate;
  gate.pause();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    gate.reset_after_fork();
    _exit(gate.may_query() && gate.permit() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_FALSE(gate.may_query());  // the parent's gate is left as it was
  gate.resume();
  EXPECT_TRUE(gate.permit());
}

// A capture's begin (QueryPause) waits for a query that got its permit before the pause: the
// query never runs once the capture has begun.
TEST(QueryGate, APauseWaitsForTheQueriesRunning) {
  QueryGate gate;
  std::atomic<bool> querying{false}, query_done{false}, begun{false};
  std::atomic<bool> release{false};
  std::thread poller([&] {
    const QueryGate::Permit permit = gate.permit();
    EXPECT_TRUE(permit);
    querying = true;
    while (!release.load()) std::this_thread::yield();
    query_done = true;  // (the query's last moment, still under the permit)
  });
  while (!querying.load()) std::this_thread::yield();
  std::thread capturer([&] {
    QueryPause pause(gate);  // returns once the poller's permit is released
    EXPECT_TRUE(query_done.load());
    begun = true;
  });
  while (gate.may_query()) std::this_thread::yield();  // the capturer paused: now it drains
  EXPECT_FALSE(gate.try_permit());                     // (no new permit is given out)
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(begun.load());
  release = true;
  poller.join();
  capturer.join();
  EXPECT_TRUE(begun.load());
  EXPECT_TRUE(gate.may_query());  // (the pause ended with its scope)
}

// Whatever fails between a capture's prepare and its registration, the pause ends.
TEST(QueryGate, APauseEndsWhenItsScopeUnwinds) {
  QueryGate gate;
  auto prepared = std::make_unique<QueryPause>(gate);  // (kept thread-locally by the runtime)
  EXPECT_FALSE(gate.may_query());
  EXPECT_THROW(
      {
        std::unique_ptr<QueryPause> begun = std::move(prepared);  // capture_begun takes it over
        throw std::runtime_error("registering the capture failed");
      },
      std::runtime_error);
  EXPECT_TRUE(gate.may_query());
  EXPECT_EQ(gate.paused(), 0);
}

// Pollers take try_permit under their own lock, host waiters take permit with none held, captures
// begin and end: no query runs while a capture is underway (TSan also checks the locking).
TEST(QueryGate, NoQueryRunsWhileACaptureIsUnderway) {
  QueryGate gate;
  std::mutex state;  // the tracker's state lock, held by a poller
  std::atomic<int> capturing{0};
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0}, queries{0};
  auto query = [&] {
    if (capturing.load() != 0) ++bad;
    ++queries;
  };
  std::thread poller([&] {
    while (!stop.load()) {
      std::lock_guard<std::mutex> lock(state);
      if (const QueryGate::Permit p = gate.try_permit()) query();
    }
  });
  std::thread waiter([&] {
    while (!stop.load()) {
      if (const QueryGate::Permit p = gate.permit()) query();
    }
  });
  std::vector<std::thread> capturers;
  for (int t = 0; t < 2; ++t) {
    capturers.emplace_back([&] {
      for (int i = 0; i < 300; ++i) {
        QueryPause pause(gate);
        ++capturing;
        std::this_thread::yield();
        --capturing;
      }
    });
  }
  for (auto& c : capturers) c.join();
  stop = true;
  poller.join();
  waiter.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(queries.load(), 0);
  EXPECT_TRUE(gate.may_query());
}

// The ledger over the capture's own positions, as graph_capture.cpp keeps it: the origin (stream 1)
// captures, a side stream is forked in (it waits for the origin), and the ledger names what ending
// the capture now would leave unjoined.
TEST(CaptureLedger, NamesTheStreamsLeftUnjoined) {
  DependencyTracker tracker;
  Ledger ledger(42, 1);
  auto ordered = [&](StreamId a, const Position& p) { return tracker.is_ordered(a, p); };
  ledger.launched(1, tracker.launch(1, {}, {10}).position.seq);
  EXPECT_TRUE(ledger.unjoined(ordered).empty());  // only the origin

  // Stream 2 forked in (join_capture_locked): it waits for the origin's captured work so far.
  ledger.join(2);
  tracker.waited(2, Position{1, 1});
  EXPECT_EQ(ledger.unjoined(ordered), std::vector<StreamId>{2});  // a fork with nothing after it
  const auto side = tracker.launch(2, {10}, {11});
  EXPECT_TRUE(side.waits.empty());  // ordered by the fork
  ledger.launched(2, side.position.seq);
  EXPECT_EQ(ledger.unjoined(ordered), std::vector<StreamId>{2});

  // Stream 3 joins by waiting for a captured event (waited()), with work nothing reads.
  ledger.join(3);
  tracker.waited(3, Position{1, 1});
  ledger.launched(3, tracker.launch(3, {}, {12}).position.seq);

  // The origin reads stream 2's output: the captured wait joins 2 back; 3 is still unjoined.
  const auto back = tracker.launch(1, {11}, {13});
  ASSERT_EQ(back.waits.size(), 1u);
  EXPECT_EQ(back.waits[0].stream, 2);
  ledger.launched(1, back.position.seq);
  EXPECT_EQ(ledger.unjoined(ordered), std::vector<StreamId>{3});

  // capture_join_back: the origin waits for 3's last captured op.
  tracker.waited(1, Position{3, ledger.last(3)});
  EXPECT_TRUE(ledger.unjoined(ordered).empty());
  EXPECT_EQ(ledger.last(2), side.position.seq);
  EXPECT_EQ(ledger.last(4), 0u);
  EXPECT_FALSE(ledger.joined(4));
}

// What the graph keeps for its lifetime: storages made before the capture, and those used off the
// stream they were born on; not those born and used on one stream (the graph's pool reuses them),
// however many other outputs came between.
TEST(CaptureLedger, KeepsWhatReplaysUseAndLeavesTheRestToThePool) {
  Ledger ledger(42, 1);
  auto before = std::make_shared<int>(1);  // a static input
  auto out = std::make_shared<int>(2);     // a static output
  auto local = std::make_shared<int>(3);   // born on 1, used on 1
  auto shared = std::make_shared<int>(4);  // born on 1, used on 2
  auto host = std::make_shared<int>(5);    // host memory a captured copy writes (kept)
  EXPECT_TRUE(use(ledger, before, 1, false));
  EXPECT_FALSE(use(ledger, before, 2, false));  // (once)
  EXPECT_FALSE(born(ledger, local, 1));
  EXPECT_TRUE(born(ledger, host, 1, /*keep=*/true));
  std::vector<Item> many;
  for (int i = 0; i < 100; ++i) {  // (the runtime's young ring forgets `local` meanwhile)
    many.push_back(std::make_shared<int>(100 + i));
    EXPECT_FALSE(born(ledger, many.back(), 1));
  }
  EXPECT_FALSE(use(ledger, local, 1, false));
  EXPECT_FALSE(use(ledger, local, 1, true));
  EXPECT_FALSE(born(ledger, shared, 1));
  EXPECT_TRUE(use(ledger, shared, 2, false));
  EXPECT_TRUE(use(ledger, out, 1, true));

  std::weak_ptr<int> w_before = before, w_local = local, w_shared = shared;
  before.reset();
  shared.reset();
  many.clear();  // freed in the capture
  Ledger::Graph g = ledger.finish();
  ASSERT_EQ(g.kept.size(), 4u);  // before, host, shared, out
  int written = 0;
  for (const auto& k : g.kept) written += k.written ? 1 : 0;
  EXPECT_EQ(written, 3);           // host, shared (born: written), out
  ASSERT_EQ(g.others.size(), 1u);  // local, still alive (the dead ones are left out)
  EXPECT_FALSE(g.others[0].ref.expired());
  EXPECT_TRUE(g.others[0].written);
  EXPECT_FALSE(w_before.expired());  // kept while the graph lives
  g.kept.clear();                    // the graph object dies
  EXPECT_TRUE(w_before.expired());
  EXPECT_TRUE(w_shared.expired());
  EXPECT_TRUE(ledger.finish().kept.empty());  // (the ledger handed everything over)
}

// Keys are addresses, which a dead storage's successor may reuse: a stale entry is replaced, so a
// storage made outside the capture at the address of one born in it is kept as made before.
TEST(CaptureLedger, AnAddressReusedAfterItsStorageDiedStartsAfresh) {
  Ledger ledger(42, 1);
  auto a = std::make_shared<int>(1);
  const uintptr_t k = key(a);
  EXPECT_FALSE(ledger.born(k, 1, false, [&] { return std::weak_ptr<int>(a); }, [&] { return a; }));
  a.reset();  // dead: its address may be reused
  auto b = std::make_shared<int>(2);
  EXPECT_TRUE(ledger.use(k, 1, false, [&] { return std::weak_ptr<int>(b); }, [&] { return b; }));
  auto c = std::make_shared<int>(3);  // (while b is kept, its key is never stale)
  EXPECT_FALSE(ledger.use(k, 1, true, [&] { return std::weak_ptr<int>(c); }, [&] { return c; }));
  const Ledger::Graph g = ledger.finish();
  ASSERT_EQ(g.kept.size(), 1u);
  EXPECT_EQ(g.kept[0].item, b);
  EXPECT_TRUE(g.kept[0].written);
}

TEST(CaptureRegistry, GateClosedWhileAnyRegistered) {
  QueryGate gate;
  CaptureRegistry<int> reg(gate);
  auto a = reg.add(1, [] { return std::make_shared<int>(1); });
  auto again = reg.add(1, [] { return std::make_shared<int>(9); });
  EXPECT_EQ(a, again);  // registered once, paused once
  reg.add(2, [] { return std::make_shared<int>(2); });
  EXPECT_FALSE(gate.may_query());
  EXPECT_EQ(*reg.find(2), 2);
  EXPECT_EQ(reg.find(3), nullptr);
  EXPECT_NE(reg.remove(1), nullptr);
  EXPECT_EQ(reg.remove(1), nullptr);  // resumed once only
  EXPECT_FALSE(gate.may_query());
  reg.remove(2);
  EXPECT_TRUE(gate.may_query());
  EXPECT_EQ(reg.size(), 0u);
}

// capture_begun: the prepare's pause ends when the begun call returns, and the registered capture
// holds its own; a failing make() registers nothing (and the prepare's pause still ends).
TEST(CaptureRegistry, TakesOverThePreparesPause) {
  QueryGate gate;
  CaptureRegistry<int> reg(gate);
  {
    QueryPause prepared(gate);
    reg.add(7, [] { return std::make_shared<int>(7); });
  }
  EXPECT_EQ(gate.paused(), 1);  // the capture's own
  {
    QueryPause prepared(gate);
    EXPECT_THROW(reg.add(8, []() -> std::shared_ptr<int> { throw std::runtime_error("no"); }),
                 std::runtime_error);
  }
  EXPECT_EQ(reg.size(), 1u);
  EXPECT_EQ(gate.paused(), 1);
  reg.remove(7);
  EXPECT_TRUE(gate.may_query());
}

TEST(CaptureRegistry, ThreadsBeginAndEndWhilePollersRead) {
  QueryGate gate;
  CaptureRegistry<int> reg(gate);
  std::atomic<bool> stop{false};
  std::atomic<int> found{0};
  std::vector<std::thread> pollers;
  for (int i = 0; i < 2; ++i) {
    pollers.emplace_back([&] {
      while (!stop.load()) {
        (void)gate.try_permit();
        if (reg.find(5) != nullptr) ++found;
      }
    });
  }
  std::vector<std::thread> capturers;
  for (int t = 0; t < 3; ++t) {
    capturers.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        const CaptureId id = static_cast<CaptureId>(1 + t * 1000 + i % 10);
        {
          QueryPause prepared(gate);
          reg.add(id, [&] { return std::make_shared<int>(t); });
        }
        EXPECT_FALSE(gate.may_query());
        reg.remove(id);
      }
    });
  }
  for (auto& th : capturers) th.join();
  stop = true;
  for (auto& th : pollers) th.join();
  EXPECT_TRUE(gate.may_query());
  EXPECT_EQ(gate.paused(), 0);
  EXPECT_EQ(reg.size(), 0u);
}

// In a forked child (no capture survives fork): nothing registered, queries allowed, and captures
// register again; the parent's are untouched. (The child exits with _exit, so the state it leaks
// on purpose is not reported.)
TEST(CaptureRegistry, ResetAfterForkForgetsCaptures) {
  QueryGate gate;
  CaptureRegistry<int> reg(gate);
  reg.add(1, [] { return std::make_shared<int>(1); });
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    reg.reset_after_fork();
    gate.reset_after_fork();
    bool ok = reg.find(1) == nullptr && gate.may_query() && reg.size() == 0 && gate.permit();
    reg.add(2, [] { return std::make_shared<int>(2); });
    ok = ok && !gate.may_query() && reg.find(2) != nullptr;
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_NE(reg.find(1), nullptr);
  EXPECT_FALSE(gate.may_query());
  reg.remove(1);
  EXPECT_TRUE(gate.may_query());
}
