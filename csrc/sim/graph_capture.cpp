// The sim twin of CUDA stream capture (see capture.h). One lock for the captures (taken with no
// other sim lock held but the race checkers', which nest inside it); the checkers are per capture.
#include "graph_capture.h"

#include "../runtime/capture_probe.h"
#include "state.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <thread>

namespace torch_pipeline {
namespace sim {
namespace {

constexpr size_t kMaxOpsListed = 4096;  // ops a capture lists (captured, eager), each

struct Capture {
  Timeline origin;
  std::thread::id thread;  // the thread that began it
  std::vector<std::string> captured_ops;
  std::vector<std::string> eager_ops;
  std::unique_ptr<RaceChecker> checker = std::make_unique<RaceChecker>();
  std::map<Timeline, Timeline> local;    // sim timeline -> the capture checker's (origin first)
  std::vector<Access> accesses;          // what the captured ops touched, in order
  std::vector<std::string> invalidated;  // the illegal calls that invalidated it, if any

  void invalidate(const std::string& why) {
    if (std::find(invalidated.begin(), invalidated.end(), why) == invalidated.end()) {
      invalidated.push_back(why);
    }
  }
};

struct Captures {
  std::mutex mutex;
  core::CaptureId next = 0;
  std::map<core::CaptureId, Capture> by_id;
  std::map<Timeline, core::CaptureId> of;  // capturing timelines
};

std::atomic<int> g_underway{0};
Captures* g_captures = new Captures();  // leaked (ops may run at exit); replaced after fork

Timeline local_locked(Capture& c, Timeline t) {
  auto it = c.local.find(t);
  if (it == c.local.end()) {
    it = c.local.emplace(t, c.checker->add_timeline(State::get().checker().label(t))).first;
  }
  return it->second;
}

core::CaptureId of_locked(Timeline t) {
  const auto it = g_captures->of.find(t);
  return it == g_captures->of.end() ? core::kNoCapture : it->second;
}

void list(std::vector<std::string>& ops, const std::string& op, Timeline t) {
  if (ops.size() < kMaxOpsListed) {
    ops.push_back(op + " on " + State::get().checker().label(t));
  }
}

std::atomic<uint64_t> g_probes{0};

core::CaptureId probe(const c10::Stream& stream) {
  g_probes.fetch_add(1, std::memory_order_relaxed);
  if (g_underway.load(std::memory_order_acquire) == 0) {
    return core::kNoCapture;  // (before the streams' lock that State::timeline takes)
  }
  return capture_of(State::get().timeline(stream));
}

}  // namespace

core::CaptureId capture_of(Timeline t) {
  if (g_underway.load(std::memory_order_acquire) == 0) {
    return core::kNoCapture;
  }
  std::lock_guard<std::mutex> lock(g_captures->mutex);
  return of_locked(t);
}

void check_not_capturing(const char* what) {
  if (g_underway.load(std::memory_order_acquire) == 0) {
    return;
  }
  std::string streams;
  {
    std::lock_guard<std::mutex> lock(g_captures->mutex);
    if (g_captures->by_id.empty()) {
      return;
    }
    for (auto& [id, c] : g_captures->by_id) {
      c.invalidate(what);
      streams += (streams.empty() ? "" : ", ") + State::get().checker().label(c.origin);
    }
  }
  TORCH_CHECK(false, "sim: ", what, " is not permitted while a stream capture is underway (on ",
              streams,
              "); the capture is invalidated (the sim twin of CUDA's "
              "cudaErrorStreamCaptureUnsupported)");
}

bool record_captured(Timeline t, const std::string& op, const std::vector<Access>& accesses) {
  if (g_underway.load(std::memory_order_acquire) == 0) {
    return false;
  }
  std::vector<Race> found;
  {
    std::lock_guard<std::mutex> lock(g_captures->mutex);
    const core::CaptureId id = of_locked(t);
    if (id == core::kNoCapture) {
      const std::thread::id me = std::this_thread::get_id();
      for (auto& [other, c] : g_captures->by_id) {
        if (c.thread == me) {
          list(c.eager_ops, op, t);  // not captured: on a GPU it runs now, outside the graph
        }
      }
      return false;
    }
    Capture& c = g_captures->by_id.at(id);
    found = c.checker->record_op(local_locked(c, t), op + " (captured)", accesses);
    c.accesses.insert(c.accesses.end(), accesses.begin(), accesses.end());
    list(c.captured_ops, op, t);
  }
  if (!found.empty()) {
    State::get().checker().note_races(found);
    if (State::get().strict()) {
      throw_races(found);
    }
  }
  return true;
}

bool captured_snapshot(Timeline t, core::CaptureId& capture, VectorClock& clock) {
  if (g_underway.load(std::memory_order_acquire) == 0) {
    return false;
  }
  std::lock_guard<std::mutex> lock(g_captures->mutex);
  capture = of_locked(t);
  if (capture == core::kNoCapture) {
    return false;
  }
  Capture& c = g_captures->by_id.at(capture);
  clock = c.checker->snapshot(local_locked(c, t));
  return true;
}

bool captured_wait(Timeline waiter, bool is_default, core::CaptureId capture,
                   const VectorClock& clock) {
  if (capture == core::kNoCapture && g_underway.load(std::memory_order_acquire) == 0) {
    return false;  // (the common case)
  }
  std::lock_guard<std::mutex> lock(g_captures->mutex);
  const core::CaptureId w = of_locked(waiter);
  if (w == core::kNoCapture && capture == core::kNoCapture) {
    return false;  // an ordinary wait
  }
  if (w != core::kNoCapture && capture != w) {
    g_captures->by_id.at(w).invalidate("a wait for an event recorded outside it");
    TORCH_CHECK(false, "sim: ", State::get().checker().label(waiter),
                " is capturing and waited "
                "for an event recorded ",
                capture == core::kNoCapture ? "outside any capture" : "in another capture",
                " (the sim twin of CUDA's cudaErrorStreamCaptureIsolation)");
  }
  auto it = g_captures->by_id.find(capture);
  if (it == g_captures->by_id.end()) {
    return true;  // recorded in a capture that is over: it stands for no work that ran
  }
  Capture& c = it->second;
  if (w == core::kNoCapture && is_default) {
    c.invalidate("a wait of a default stream for an event recorded in it");
    TORCH_CHECK(false, "sim: ", State::get().checker().label(waiter),
                " is a default stream and "
                "waited for an event recorded in a capture underway; a default stream never "
                "joins a capture (the sim twin of CUDA's cudaErrorStreamCaptureImplicit for the "
                "legacy default stream)");
  }
  if (w == core::kNoCapture) {
    g_captures->of[waiter] = capture;  // the waiter joins the capture
  }
  c.checker->join(local_locked(c, waiter), clock);
  return true;
}

void Graph::replay(const c10::Stream& stream) const {
  check_device(stream.device_index());
  record(State::get().timeline(stream), "sim graph replay", accesses_);
}

core::CaptureId begin_capture(const c10::Stream& stream) {
  const Timeline t = State::get().timeline(stream);
  TORCH_CHECK(stream.id() != c10::Stream::DEFAULT,
              "sim: graphs must be captured on a non-default stream (as CUDA graphs are)");
  std::lock_guard<std::mutex> lock(g_captures->mutex);
  TORCH_CHECK(of_locked(t) == core::kNoCapture, "sim: ", State::get().checker().label(t),
              " is capturing already");
  const core::CaptureId id = ++g_captures->next;
  Capture& c = g_captures->by_id[id];
  c.origin = t;
  c.thread = std::this_thread::get_id();
  local_locked(c, t);
  g_captures->of[t] = id;
  g_underway.fetch_add(1, std::memory_order_acq_rel);
  return id;
}

std::shared_ptr<Graph> end_capture(const c10::Stream& stream) {
  const Timeline t = State::get().timeline(stream);
  Capture c;
  std::vector<std::string> unjoined;
  {
    std::lock_guard<std::mutex> lock(g_captures->mutex);
    const core::CaptureId id = of_locked(t);
    TORCH_CHECK(id != core::kNoCapture, "sim: end_capture: ", State::get().checker().label(t),
                " is not capturing");
    auto it = g_captures->by_id.find(id);
    TORCH_CHECK(it->second.origin == t,
                "sim: end_capture must be called on the stream the "
                "capture began on (",
                State::get().checker().label(it->second.origin), ")");
    c = std::move(it->second);
    g_captures->by_id.erase(it);
    for (auto i = g_captures->of.begin(); i != g_captures->of.end();) {
      i = i->second == id ? g_captures->of.erase(i) : std::next(i);
    }
    g_underway.fetch_sub(1, std::memory_order_acq_rel);
    // Joined back: the origin is ordered after each joined stream's last captured op.
    const VectorClock origin = c.checker->snapshot(c.local.at(t));
    for (const auto& [sim_t, local] : c.local) {
      if (sim_t != t &&
          clock_entry(origin, local) < clock_entry(c.checker->snapshot(local), local)) {
        unjoined.push_back(State::get().checker().label(sim_t));
      }
    }
  }
  if (!c.invalidated.empty()) {
    std::string why;
    for (const std::string& w : c.invalidated) why += (why.empty() ? "" : ", ") + w;
    TORCH_CHECK(false, "sim: the capture on ", State::get().checker().label(t),
                " was invalidated by ", why,
                " while it was underway (the sim twin of CUDA's "
                "cudaErrorStreamCaptureInvalidated)");
  }
  if (!unjoined.empty()) {
    std::string names;
    for (const std::string& n : unjoined) names += (names.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, "sim: the capture on ", State::get().checker().label(t), " has work on ",
                names,
                " that it never waited for (the sim twin of CUDA's "
                "cudaErrorStreamCaptureUnjoined)");
  }
  return std::make_shared<Graph>(std::move(c.accesses), std::move(c.captured_ops),
                                 std::move(c.eager_ops));
}

uint64_t probe_calls() { return g_probes.load(std::memory_order_relaxed); }

void register_capture_probe() { torch_pipeline::register_capture_probe(kSim, &probe); }

void reset_captures_in_child() {
  g_captures = new Captures();  // (the parent's may be locked by a thread now gone: leaked)
  g_underway.store(0);
}

}  // namespace sim
}  // namespace torch_pipeline
