// Graph capture as the tracker sees it (core/capture_state.h), driven by a fake device that
// behaves like CUDA's global capture mode where it matters: while a capture is underway any
// query raises and invalidates it; a stream that waits for an event recorded in a capture joins
// it; a capturing stream that waits for an event recorded outside its capture is an error; ending
// a capture with a joined stream whose work the origin never waited for is an error.
#include "core/capture_state.h"
#include "core/dependency_tracker.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

using torch_pipeline::core::CapturedGraph;
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
using torch_pipeline::core::StorageId;
using torch_pipeline::core::StreamId;

namespace {

// The fake capture state: which stream captures into which capture, and what is illegal.
class FakeDevice {
 public:
  struct Event {
    CaptureId capture = kNoCapture;  // recorded in this capture
  };

  CaptureId begin(StreamId s) {
    const CaptureId id = ++next_;
    captures_[id] = Capture{s, false};
    of_[s] = id;
    return id;
  }
  CaptureId status(StreamId s) const {
    const auto it = of_.find(s);
    return it == of_.end() ? kNoCapture : it->second;
  }
  bool any() const { return !captures_.empty(); }
  Event record(StreamId s) const { return Event{status(s)}; }
  // cudaStreamWaitEvent during capture.
  void wait(StreamId waiter, const Event& e) {
    const CaptureId w = status(waiter);
    if (w != kNoCapture && e.capture != w) {
      throw std::runtime_error("isolation: a capturing stream waited for an event of elsewhere");
    }
    if (w == kNoCapture && e.capture != kNoCapture) {
      of_[waiter] = e.capture;  // joins the capture
    }
  }
  // cudaEventQuery / synchronize: illegal in every thread while a capture is underway.
  void query() {
    if (any()) {
      for (auto& [id, c] : captures_) c.invalidated = true;
      throw std::runtime_error("cudaErrorStreamCaptureUnsupported");
    }
  }
  // cudaStreamEndCapture on the origin: `unjoined` is what the tracker's ledger says.
  void end(StreamId origin, bool any_unjoined) {
    const CaptureId id = status(origin);
    ASSERT_NE(id, kNoCapture);
    const bool invalidated = captures_[id].invalidated;
    captures_.erase(id);
    for (auto it = of_.begin(); it != of_.end();) {
      it = it->second == id ? of_.erase(it) : std::next(it);
    }
    if (invalidated) throw std::runtime_error("cudaErrorStreamCaptureInvalidated");
    if (any_unjoined) throw std::runtime_error("cudaErrorStreamCaptureUnjoined");
  }

 private:
  struct Capture {
    StreamId origin;
    bool invalidated;
  };
  CaptureId next_ = 100;
  std::map<CaptureId, Capture> captures_;
  std::map<StreamId, CaptureId> of_;
};

using Item = std::shared_ptr<int>;
using Ledger = CaptureLedger<Item, std::weak_ptr<int>>;
using Graph = CapturedGraph<Item, std::weak_ptr<int>>;

// A capture's tracking: its own dependency tracker (positions inside the capture) and ledger.
struct World {
  World(CaptureId id, StreamId origin) : ledger(id, origin) {}
  DependencyTracker tracker;
  Ledger ledger;
};

// The tracker's side of the protocol, as csrc/runtime/tracking/capture.cpp does it, over the
// fake device: routes each launch, forks streams into the thread's capture, inserts in-capture
// waits as captured record+wait, and polls only when the gate allows it.
class Runtime {
 public:
  explicit Runtime(FakeDevice& d, bool pause = true) : dev(d), registry(gate), pause_(pause) {}

  void begin(StreamId origin) {
    QueryPause pause(gate);  // (before the device begins: no poll slips in between)
    const CaptureId id = dev.begin(origin);
    world = registry.add(id, [&] { return std::make_shared<World>(id, origin); });
    thread_capture = id;
  }

  // An op on stream s reading/writing storages; returns the waits it made.
  std::vector<Position> launch(StreamId s, const std::vector<StorageId>& reads,
                               const std::vector<StorageId>& writes) {
    poll();
    switch (route_launch(thread_capture, dev.status(s))) {
      case CaptureRoute::kEager:
        return eager.launch(s, reads, writes).waits;
      case CaptureRoute::kMixed:
        throw std::logic_error("mixed captures");
      case CaptureRoute::kFork: {
        const StreamId o = world->ledger.origin();
        dev.wait(s, dev.record(o));  // fork: s joins the capture
        world->tracker.waited(s, Position{o, world->ledger.last(o)});
        world->ledger.join(s);
        ++forks;
        break;
      }
      case CaptureRoute::kCaptured:
        break;
    }
    auto l = world->tracker.launch(s, reads, writes);
    for (const Position& w : l.waits) {
      dev.wait(s, dev.record(w.stream));  // a captured record + wait: legal
    }
    world->ledger.launched(s, l.position.seq);
    return l.waits;
  }

  // Ends the capture on its origin: the ledger names the streams not joined back.
  std::vector<StreamId> end(bool join_first = false) {
    const StreamId o = world->ledger.origin();
    auto ordered = [&](StreamId a, Position p) { return world->tracker.is_ordered(a, p); };
    std::vector<StreamId> unjoined = world->ledger.unjoined(ordered);
    if (join_first) {
      for (StreamId s : unjoined) {
        dev.wait(o, dev.record(s));
        world->tracker.waited(o, Position{s, world->ledger.last(s)});
      }
    }
    const bool any = !world->ledger.unjoined(ordered).empty();
    registry.remove(world->ledger.id());
    thread_capture = kNoCapture;
    dev.end(o, any);
    return unjoined;
  }

  void poll() {
    if (!pause_ || gate.may_query()) {
      dev.query();
      ++polls;
    }
  }

  FakeDevice& dev;
  QueryGate gate;
  CaptureRegistry<World> registry;
  DependencyTracker eager;
  std::shared_ptr<World> world;
  CaptureId thread_capture = kNoCapture;
  int forks = 0;
  int polls = 0;
  bool pause_;
};

}  // namespace

TEST(CaptureRoute, FromThreadAndStreamCapture) {
  EXPECT_EQ(route_launch(kNoCapture, kNoCapture), CaptureRoute::kEager);
  EXPECT_EQ(route_launch(7, kNoCapture), CaptureRoute::kFork);
  EXPECT_EQ(route_launch(7, 7), CaptureRoute::kCaptured);
  EXPECT_EQ(route_launch(kNoCapture, 7), CaptureRoute::kCaptured);  // a capture begun elsewhere
  EXPECT_EQ(route_launch(7, kUnknownCapture), CaptureRoute::kCaptured);  // invalidated
  EXPECT_EQ(route_launch(7, 8), CaptureRoute::kMixed);
}

TEST(QueryGate, PausesNestAndCountResumes) {
  QueryGate gate;
  EXPECT_TRUE(gate.may_query());
  gate.pause();
  gate.pause();
  EXPECT_FALSE(gate.may_query());
  gate.resume();
  EXPECT_FALSE(gate.may_query());
  EXPECT_EQ(gate.resumes(), 0u);
  gate.resume();
  EXPECT_TRUE(gate.may_query());
  EXPECT_EQ(gate.resumes(), 1u);
  gate.pause();
  gate.reset_after_fork();
  EXPECT_TRUE(gate.may_query());
}

TEST(QueryGate, PauseGuardResumesUnlessKept) {
  QueryGate gate;
  {
    QueryPause p(gate);  // a capture's begin that failed
    EXPECT_FALSE(gate.may_query());
  }
  EXPECT_TRUE(gate.may_query());
  {
    QueryPause p(gate);
    p.keep();  // it began: paused until its end
  }
  EXPECT_FALSE(gate.may_query());
  gate.resume();
  EXPECT_TRUE(gate.may_query());
}

TEST(Capture, NoQueryWhileUnderwayAndTheTwinWithoutPauseFails) {
  FakeDevice dev;
  Runtime rt(dev);
  rt.launch(1, {}, {10});
  const int before = rt.polls;
  rt.begin(2);
  rt.launch(2, {10}, {11});
  rt.launch(3, {11}, {12});
  rt.launch(2, {12}, {13});
  EXPECT_EQ(rt.polls, before);  // paused
  EXPECT_NO_THROW(rt.end());
  rt.launch(1, {13}, {});
  EXPECT_EQ(rt.polls, before + 1);  // resumed

  FakeDevice dev2;
  Runtime unpaused(dev2, /*pause=*/false);
  unpaused.begin(2);
  EXPECT_THROW(unpaused.launch(2, {10}, {11}), std::runtime_error);  // the illegal query
  EXPECT_THROW(unpaused.end(), std::runtime_error);                  // invalidated
}

TEST(Capture, WaitsInsideAreCapturedEdgesAndNothingWaitsOutside) {
  FakeDevice dev;
  Runtime rt(dev);
  rt.launch(1, {}, {10});  // produced outside the capture, on stream 1
  rt.begin(2);
  // Inside, the producer on stream 1 is not waited for (replays are ordered instead): a wait on
  // an event of outside would be an isolation error on the device.
  EXPECT_TRUE(rt.launch(2, {10}, {11}).empty());
  // A side stream: forked in, then ordered after the origin's write of 11 by the fork itself.
  EXPECT_TRUE(rt.launch(3, {11}, {12}).empty());
  EXPECT_EQ(rt.forks, 1);
  // Back on the origin: waits for the side's write of 12, a captured edge, which joins it back.
  const auto w = rt.launch(2, {12}, {13});
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].stream, 3);
  EXPECT_TRUE(rt.end().empty());
}

TEST(Capture, SideStreamNotJoinedBackIsNamed) {
  FakeDevice dev;
  Runtime rt(dev);
  rt.begin(2);
  rt.launch(2, {}, {11});
  rt.launch(3, {11}, {12});  // side work nobody on the origin waits for
  rt.launch(4, {}, {14});    // another one
  rt.launch(2, {14}, {15});  // ... but this one is joined back
  std::vector<StreamId> unjoined;
  EXPECT_THROW(unjoined = rt.end(), std::runtime_error);  // the device's own error

  FakeDevice dev2;
  Runtime joined(dev2);
  joined.begin(2);
  joined.launch(2, {}, {11});
  joined.launch(3, {11}, {12});
  joined.launch(4, {}, {14});
  joined.launch(2, {14}, {15});
  const auto named = joined.end(/*join_first=*/true);  // joined before ending: no device error
  ASSERT_EQ(named.size(), 1u);
  EXPECT_EQ(named[0], 3);
}

TEST(CaptureLedger, KeepsForTheGraphsLifetimeAndUsesWeakly) {
  Ledger ledger(1, 2);
  auto before = std::make_shared<int>(1);   // existed before the capture
  auto inside = std::make_shared<int>(2);   // made in it, used on its own stream only
  auto foreign = std::make_shared<int>(3);  // made in it, used on another stream
  ledger.use(1, false, [&] { return std::weak_ptr<int>(before); });
  ledger.use(2, true, [&] { return std::weak_ptr<int>(inside); });
  ledger.use(3, true, [&] { return std::weak_ptr<int>(foreign); });
  ledger.use(3, false, [&] { return std::weak_ptr<int>(foreign); });
  EXPECT_TRUE(ledger.keep(1, [&] { return before; }));
  EXPECT_TRUE(ledger.keep(3, [&] { return foreign; }));
  EXPECT_FALSE(ledger.keep(3, [&] { return foreign; }));  // once
  EXPECT_EQ(ledger.kept_count(), 2u);
  EXPECT_EQ(ledger.use_count(), 3u);

  std::weak_ptr<int> w_before = before, w_inside = inside, w_foreign = foreign;
  before.reset();
  foreign.reset();
  inside.reset();  // freed in the capture (its block goes back to the graph's pool)
  auto g = std::make_unique<Graph>(ledger.finish());
  EXPECT_EQ(ledger.kept_count(), 0u);
  EXPECT_FALSE(w_before.expired());  // kept while the graph lives
  EXPECT_FALSE(w_foreign.expired());
  EXPECT_TRUE(w_inside.expired());
  int alive = 0, written = 0;
  g->for_each_alive([&](const std::weak_ptr<int>&, bool, bool w) {
    ++alive;
    written += w ? 1 : 0;
  });
  EXPECT_EQ(alive, 2);
  EXPECT_EQ(written, 1);
  g.reset();  // the graph object dies
  EXPECT_TRUE(w_before.expired());
  EXPECT_TRUE(w_foreign.expired());
}

TEST(CapturedGraph, ResetDropsWhatItKept) {
  Ledger ledger(1, 2);
  auto x = std::make_shared<int>(1);
  ledger.use(1, true, [&] { return std::weak_ptr<int>(x); });
  ledger.keep(1, [&] { return x; });
  std::weak_ptr<int> wx = x;
  x.reset();
  Graph g(ledger.finish());
  EXPECT_EQ(g.kept(), 1u);
  g.reset();
  EXPECT_TRUE(wx.expired());
  int n = 0;
  g.for_each_alive([&](const std::weak_ptr<int>&, bool, bool) { ++n; });
  EXPECT_EQ(n, 0);
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

TEST(CaptureRegistry, ThreadsBeginAndEndWhilePollersRead) {
  QueryGate gate;
  CaptureRegistry<int> reg(gate);
  std::atomic<bool> stop{false};
  std::atomic<int> found{0};
  std::vector<std::thread> pollers;
  for (int i = 0; i < 2; ++i) {
    pollers.emplace_back([&] {
      while (!stop.load()) {
        (void)gate.may_query();
        if (reg.find(5) != nullptr) ++found;
      }
    });
  }
  std::vector<std::thread> capturers;
  for (int t = 0; t < 3; ++t) {
    capturers.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        const CaptureId id = static_cast<CaptureId>(1 + t * 1000 + i % 10);
        reg.add(id, [&] { return std::make_shared<int>(t); });
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
    bool ok = reg.find(1) == nullptr && gate.may_query() && reg.size() == 0;
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
