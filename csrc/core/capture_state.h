// Plain C++17 (no torch includes). The tracker's view of graph captures (CUDA stream capture
// under torch.cuda.graph, or the sim device's twin), docs/design.md, "Graph capture":
//
// * QueryGate: whether a capture is underway (or about to begin) in the process. CUDA's default
//   (global) capture mode makes every event or stream query and every synchronization illegal in
//   every thread while one is (cudaErrorStreamCaptureUnsupported, and the capture is
//   invalidated), so the tracker makes its queries under a Permit, which the gate refuses while
//   paused; a capture's begin pauses it and drains the queries already running (QueryPause).
// * route_launch: where an op goes, from the capture the launching thread began and the one the
//   device reports for the stream it launches on: tracked as usual, captured, forked into the
//   thread's capture first (a side pipeline's stream), or an error (two captures mixed).
// * CaptureLedger: one capture: its origin stream, the streams that joined it with the last
//   position captured on each (the ones not joined back at its end), and what the graph touched:
//   each storage once, whether it was born in the capture and on which stream, whether the graph
//   writes it, and whether it is kept alive for the graph's lifetime.
// * CaptureRegistry: the captures underway, by id, each holding the gate paused.
// The runtime (csrc/runtime/tracking/graph_capture.*) binds these to c10 streams and storages; the
// GoogleTest tests/cpp/test_capture_state.cpp drives them as the runtime does.
#pragma once

#include "dependency_tracker.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace core {

// A capture as the device names it (cudaStreamGetCaptureInfo's id, unique in the process; the
// sim device's serial). 0: not capturing. kUnknownCapture: capturing, but the device cannot say
// which capture (CUDA reports no id for an invalidated capture).
using CaptureId = uint64_t;
constexpr CaptureId kNoCapture = 0;
constexpr CaptureId kUnknownCapture = ~CaptureId{0};

// Process-wide: while any capture is underway (or about to begin), device queries and
// synchronizations must not be made. pause()/resume() nest (one pair per capture). A query is
// made under a Permit, which is empty while paused; drain() waits for the permits given out
// before a pause. Lock-free while open except for the shared lock a permit holds.
class QueryGate {
 public:
  QueryGate() : sync_(new Sync()) {}
  ~QueryGate() { delete sync_; }
  QueryGate(const QueryGate&) = delete;
  QueryGate& operator=(const QueryGate&) = delete;

  void pause() { paused_.fetch_add(1, std::memory_order_acq_rel); }
  void resume() { paused_.fetch_sub(1, std::memory_order_acq_rel); }
  // After pause(): returns once no query that got its permit before is still running (no new one
  // is given out). Never call it while holding a permit (it would wait for itself).
  void drain() { std::unique_lock<std::shared_mutex> wait_for_queries(sync_->mutex); }

  // No capture underway: events and streams may be queried and synchronized.
  bool may_query() const { return paused_.load(std::memory_order_acquire) <= 0; }
  int64_t paused() const { return paused_.load(std::memory_order_acquire); }

  // Held while a device query (or several) runs; empty (false) when the gate is paused. A pause
  // that begins while one is held waits, in drain(), until it is released.
  class Permit {
   public:
    Permit() = default;
    explicit operator bool() const { return lock_.owns_lock(); }

   private:
    friend class QueryGate;
    std::shared_lock<std::shared_mutex> lock_;
  };
  // Blocks only while a drain() is finishing (it holds the lock exclusively for an instant).
  Permit permit() {
    Permit p;
    if (may_query()) {
      p.lock_ = std::shared_lock<std::shared_mutex>(sync_->mutex);
      if (!may_query()) p.lock_.unlock();  // paused meanwhile: the pause's drain is waiting
    }
    return p;
  }
  // Never blocks (for callers that hold other locks): also empty while a drain() holds the lock.
  Permit try_permit() {
    Permit p;
    if (may_query()) {
      p.lock_ = std::shared_lock<std::shared_mutex>(sync_->mutex, std::try_to_lock);
      if (p.lock_ && !may_query()) p.lock_.unlock();
    }
    return p;
  }

  // In a forked child: no capture survives fork (CUDA is unusable there; sim drops its state).
  // The lock a thread of the parent held is left behind (leaked).
  void reset_after_fork() {
    sync_ = new Sync();
    paused_.store(0);
  }

 private:
  struct Sync {
    std::shared_mutex mutex;
  };
  std::atomic<int64_t> paused_{0};
  Sync* sync_;
};

// Pauses `gate` for a scope (from just before a capture's begin until the capture is registered,
// or the begin failed): the constructor returns once the queries running then are over.
class QueryPause {
 public:
  explicit QueryPause(QueryGate& gate) : gate_(&gate) {
    gate_->pause();
    gate_->drain();
  }
  ~QueryPause() { gate_->resume(); }
  QueryPause(const QueryPause&) = delete;
  QueryPause& operator=(const QueryPause&) = delete;

 private:
  QueryGate* gate_;
};

enum class CaptureRoute {
  kEager,     // no capture involved: tracked as usual
  kCaptured,  // the stream is capturing in the thread's capture (or the thread has none):
              // recorded into the graph, not run now
  kFork,      // the thread is capturing and the stream is not: fork it into the capture first
              // (it waits for an event recorded on the origin), then capture
  kMixed,     // the stream is in another capture than the thread's: an error
};

// `thread_capture`: the capture the launching thread began (kNoCapture if none);
// `stream_capture`: what the device reports for the stream launched on.
inline CaptureRoute route_launch(CaptureId thread_capture, CaptureId stream_capture) {
  if (stream_capture == kNoCapture) {
    return thread_capture == kNoCapture ? CaptureRoute::kEager : CaptureRoute::kFork;
  }
  if (thread_capture == kNoCapture || thread_capture == stream_capture ||
      stream_capture == kUnknownCapture) {
    return CaptureRoute::kCaptured;
  }
  return CaptureRoute::kMixed;
}

// One capture. Keys are storage addresses; Strong keeps an item alive, Weak refers to it without
// (Weak needs `bool expired() const`). Streams are the ids of the capture's own tracker.
template <typename Strong, typename Weak>
class CaptureLedger {
 public:
  CaptureLedger(CaptureId id, StreamId origin) : id_(id), origin_(origin) { join(origin); }

  CaptureId id() const { return id_; }
  StreamId origin() const { return origin_; }

  // `s` joined the capture (the origin; a stream forked from it; one that waited for an event
  // recorded in the capture). Idempotent.
  void join(StreamId s) {
    if (!joined(s)) streams_.push_back(Joined{s, 0});
  }
  bool joined(StreamId s) const { return find(s) != nullptr; }
  // An op was captured at position `seq` of stream `s` (which joins, if it had not).
  void launched(StreamId s, uint64_t seq) {
    Joined* j = find(s);
    if (j == nullptr) {
      join(s);
      j = &streams_.back();
    }
    j->last = std::max(j->last, seq);
  }
  uint64_t last(StreamId s) const {
    const Joined* j = find(s);
    return j == nullptr ? 0 : j->last;
  }

  // The joined streams (not the origin) that ending the capture now would leave unjoined (CUDA:
  // cudaErrorStreamCaptureUnjoined): those with captured work the origin is not ordered after
  // (`ordered(origin, Position{s, last})` answers: DependencyTracker::is_ordered), and those that
  // joined without capturing any op (a fork, or a wait for a captured event, with nothing after:
  // the stream is in the capture all the same).
  template <typename Ordered>
  std::vector<StreamId> unjoined(Ordered&& ordered) const {
    std::vector<StreamId> out;
    for (const Joined& j : streams_) {
      if (j.stream != origin_ && (j.last == 0 || !ordered(origin_, Position{j.stream, j.last}))) {
        out.push_back(j.stream);
      }
    }
    return out;
  }

  // A fresh output of a captured op, made on joined stream `home`: the graph writes it. Kept for
  // the graph's lifetime when `keep` (host memory a captured copy writes at every replay).
  // Returns whether it was newly kept.
  template <typename MakeWeak, typename MakeStrong>
  bool born(uintptr_t key, StreamId home, bool keep, MakeWeak&& make_weak,
            MakeStrong&& make_strong) {
    Touched& t = touch(key, make_weak);
    if (!t.strong.has_value()) {
      t.home = home;  // (a storage the capture used before, now dead, at this address: reborn)
    }
    t.written = true;
    return keep && hold(t, make_strong);
  }
  // The captured op uses the storage at `key` on joined stream `on`. It is kept alive for the
  // graph's lifetime when it was not born in the capture (the graph's static inputs and outputs:
  // every replay uses them), or when it is used off the stream it was born on (the allocator must
  // not hand its block to later captured work of that stream, which the graph may run alongside
  // the use). Returns whether it was newly kept.
  template <typename MakeWeak, typename MakeStrong>
  bool use(uintptr_t key, StreamId on, bool write, MakeWeak&& make_weak, MakeStrong&& make_strong) {
    Touched& t = touch(key, make_weak);
    t.written = t.written || write;
    return t.home != on && hold(t, make_strong);  // (home 0: made before; never a stream id)
  }

  // What the graph object keeps when the capture ended: the storages kept for its lifetime and
  // weak references to the others it touches that are still alive, each once, with whether the
  // graph writes it (for ordering its replays like one op).
  struct Kept {
    Strong item;
    bool written;
  };
  struct Other {
    Weak ref;
    bool written;
  };
  struct Graph {
    std::vector<Kept> kept;
    std::vector<Other> others;
  };
  // The ledger's storages are handed over: it is empty afterwards.
  Graph finish() {
    Graph g;
    for (auto& [key, t] : touched_) {
      if (t.strong.has_value()) {
        g.kept.push_back(Kept{std::move(*t.strong), t.written});
      } else if (!t.ref.expired()) {
        g.others.push_back(Other{std::move(t.ref), t.written});
      }
    }
    touched_.clear();
    return g;
  }

 private:
  struct Joined {
    StreamId stream;
    uint64_t last;  // the last position captured there (0: none yet)
  };
  struct Touched {
    explicit Touched(Weak r) : ref(std::move(r)) {}
    Weak ref;
    StreamId home = 0;  // the stream it was born on in the capture (0: made before it)
    bool written = false;
    std::optional<Strong> strong;  // kept for the graph's lifetime
  };
  Joined* find(StreamId s) {
    for (Joined& j : streams_) {
      if (j.stream == s) return &j;
    }
    return nullptr;
  }
  const Joined* find(StreamId s) const {
    for (const Joined& j : streams_) {
      if (j.stream == s) return &j;
    }
    return nullptr;
  }
  // The entry of `key`; a fresh one if it had none or its storage died (the address is reused).
  template <typename MakeWeak>
  Touched& touch(uintptr_t key, MakeWeak&& make_weak) {
    auto it = touched_.find(key);
    if (it == touched_.end()) {
      it = touched_.emplace(key, Touched(make_weak())).first;
    } else if (!it->second.strong.has_value() && it->second.ref.expired()) {
      it->second = Touched(make_weak());
    }
    return it->second;
  }
  template <typename MakeStrong>
  static bool hold(Touched& t, MakeStrong&& make_strong) {
    if (t.strong.has_value()) return false;
    t.strong.emplace(make_strong());
    return true;
  }

  CaptureId id_;
  StreamId origin_;
  std::vector<Joined> streams_;
  std::unordered_map<uintptr_t, Touched> touched_;
};

// The captures underway in the process, by id, each with the runtime's state of it (Tracked): a
// capture registered here holds the gate paused until it is removed. Thread-safe; size() is one
// atomic load (the op path's check that no capture is underway).
template <typename Tracked>
class CaptureRegistry {
 public:
  explicit CaptureRegistry(QueryGate& gate) : gate_(&gate), sync_(new Sync()) {}
  ~CaptureRegistry() { delete sync_; }
  CaptureRegistry(const CaptureRegistry&) = delete;
  CaptureRegistry& operator=(const CaptureRegistry&) = delete;

  // Registers capture `id` (if it is known already, returns the one registered); the gate stays
  // paused until remove(id). `make()` builds its state (if it throws, nothing is registered).
  template <typename Make>
  std::shared_ptr<Tracked> add(CaptureId id, Make&& make) {
    std::lock_guard<std::mutex> lock(sync_->mutex);
    auto it = sync_->captures.find(id);
    if (it != sync_->captures.end()) return it->second;
    std::shared_ptr<Tracked> w = make();
    sync_->captures.emplace(id, w);
    gate_->pause();
    size_.store(sync_->captures.size(), std::memory_order_release);
    return w;
  }
  // The state of capture `id`; nullptr if it is not registered.
  std::shared_ptr<Tracked> find(CaptureId id) const {
    if (size_.load(std::memory_order_acquire) == 0) return nullptr;  // (the common case)
    std::lock_guard<std::mutex> lock(sync_->mutex);
    const auto it = sync_->captures.find(id);
    return it == sync_->captures.end() ? nullptr : it->second;
  }
  // Capture `id` ended: unregistered, and the gate resumes (once per add). Returns its state.
  std::shared_ptr<Tracked> remove(CaptureId id) {
    std::lock_guard<std::mutex> lock(sync_->mutex);
    auto it = sync_->captures.find(id);
    if (it == sync_->captures.end()) return nullptr;
    std::shared_ptr<Tracked> w = std::move(it->second);
    sync_->captures.erase(it);
    size_.store(sync_->captures.size(), std::memory_order_release);
    gate_->resume();
    return w;
  }
  size_t size() const { return size_.load(std::memory_order_acquire); }
  // In a forked child (only the forking thread exists, and no capture survives fork): forgets
  // every capture without taking the lock another thread may have held (the old one is leaked).
  void reset_after_fork() {
    sync_ = new Sync();
    size_.store(0);
  }

 private:
  struct Sync {
    std::mutex mutex;
    std::unordered_map<CaptureId, std::shared_ptr<Tracked>> captures;
  };
  QueryGate* gate_;
  Sync* sync_;
  std::atomic<size_t> size_{0};
};

}  // namespace core
}  // namespace torch_pipeline
