// Plain C++17 (no torch includes). The tracker's view of graph captures (CUDA stream capture
// under torch.cuda.graph, or the sim device's twin), docs/design.md §4 "Graph capture":
//
// * QueryGate: whether any capture is underway in the process. CUDA's default (global) capture
//   mode makes every event or stream query and every synchronization illegal in every thread
//   while one is (cudaErrorStreamCaptureUnsupported, and the capture is invalidated), so the
//   tracker's keep-alive polls and host waits pause while the gate is closed. Lock-free reads.
// * route_launch: where an op goes, from the capture the launching thread began and the one the
//   device reports for the stream it launches on: tracked as usual, captured, forked into the
//   thread's capture first (a side pipeline's stream), or an error (two captures mixed).
// * CaptureLedger: one capture: its origin stream, the streams that joined it with the last
//   position captured on each, the ones not joined back at its end, what the graph touched
//   (each storage once, read or written) and what it keeps alive for its lifetime.
// * CapturedGraph: what a finished capture leaves the graph object: the items kept for its
//   lifetime and weak references to what it touches (for ordering its replays).
// The runtime (csrc/runtime/tracking/capture.*) binds these to c10 streams and storages; the
// GoogleTest tests/cpp/test_capture_state.cpp drives them with a fake device.
#pragma once

#include "dependency_tracker.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
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
// synchronizations must not be made. pause()/resume() nest (one pair per capture).
class QueryGate {
 public:
  void pause() { paused_.fetch_add(1, std::memory_order_acq_rel); }
  void resume() {
    const int64_t before = paused_.fetch_sub(1, std::memory_order_acq_rel);
    if (before == 1) {
      resumes_.fetch_add(1, std::memory_order_acq_rel);
    }
  }
  // No capture underway: events and streams may be queried and synchronized.
  bool may_query() const { return paused_.load(std::memory_order_acquire) <= 0; }
  int64_t paused() const { return paused_.load(std::memory_order_acquire); }
  // How often queries resumed: a poll skipped while paused is due once this changed.
  uint64_t resumes() const { return resumes_.load(std::memory_order_acquire); }
  // In a forked child: no capture survives fork (CUDA is unusable there; sim drops its state).
  void reset_after_fork() { paused_.store(0); }

 private:
  std::atomic<int64_t> paused_{0};
  std::atomic<uint64_t> resumes_{0};
};

// Pauses `gate` for a scope (a capture's begin that may fail).
class QueryPause {
 public:
  explicit QueryPause(QueryGate& gate) : gate_(&gate) { gate_->pause(); }
  ~QueryPause() {
    if (gate_ != nullptr) gate_->resume();
  }
  // The capture began: the pause now lasts until its end (the caller resumes then).
  void keep() { gate_ = nullptr; }
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
// (Weak needs `bool expired() const`).
template <typename Strong, typename Weak>
class CaptureLedger {
 public:
  struct Use {
    Weak ref;
    bool read = false;
    bool written = false;
  };

  CaptureLedger(CaptureId id, StreamId origin) : id_(id), origin_(origin) { join(origin); }

  CaptureId id() const { return id_; }
  StreamId origin() const { return origin_; }

  // `s` joined the capture (the origin; a stream forked from it; one that waited for an event
  // recorded in the capture). Idempotent.
  void join(StreamId s) {
    if (!joined(s)) streams_.push_back(Joined{s, 0});
  }
  bool joined(StreamId s) const { return find(s) != nullptr; }
  // Streams in the capture, in the order they joined (the origin first).
  std::vector<StreamId> streams() const {
    std::vector<StreamId> out;
    for (const Joined& j : streams_) out.push_back(j.stream);
    return out;
  }
  // An op was captured at position `seq` of joined stream `s`.
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

  // The joined streams (not the origin) with captured work that the origin is not ordered after:
  // `ordered(origin, Position{s, last})` answers (DependencyTracker::is_ordered). Ending the
  // capture now would leave them unjoined (CUDA: cudaErrorStreamCaptureUnjoined).
  template <typename Ordered>
  std::vector<StreamId> unjoined(Ordered&& ordered) const {
    std::vector<StreamId> out;
    for (const Joined& j : streams_) {
      if (j.stream != origin_ && j.last != 0 && !ordered(origin_, Position{j.stream, j.last})) {
        out.push_back(j.stream);
      }
    }
    return out;
  }

  // The graph touches the storage at `key` (make_weak() names it, once).
  template <typename MakeWeak>
  void use(uintptr_t key, bool write, MakeWeak&& make_weak) {
    auto it = uses_.find(key);
    if (it == uses_.end()) {
      it = uses_.emplace(key, Use{make_weak(), false, false}).first;
    }
    (write ? it->second.written : it->second.read) = true;
  }
  // Keeps the storage at `key` alive for the graph's lifetime (make_strong() holds it, once):
  // it existed before the capture (the graph reads or writes it at every replay), or it is used
  // in the capture off the stream it was allocated on (the allocator must not hand its block to
  // later captured work of that stream, which the graph may run alongside the use). Returns
  // whether it was newly kept.
  template <typename MakeStrong>
  bool keep(uintptr_t key, MakeStrong&& make_strong) {
    if (kept_keys_.count(key) != 0) return false;
    kept_keys_.emplace(key, kept_.size());
    kept_.push_back(make_strong());
    return true;
  }
  bool kept(uintptr_t key) const { return kept_keys_.count(key) != 0; }
  size_t kept_count() const { return kept_.size(); }
  size_t use_count() const { return uses_.size(); }

  // The capture ended: what the graph object keeps. The ledger is empty afterwards.
  struct Graph {
    std::vector<Strong> kept;
    std::vector<Use> uses;  // storages still alive at the end, each once
  };
  Graph finish() {
    Graph g;
    g.kept = std::move(kept_);
    for (auto& [key, u] : uses_) {
      if (!u.ref.expired()) g.uses.push_back(std::move(u));
    }
    kept_.clear();
    kept_keys_.clear();
    uses_.clear();
    return g;
  }

 private:
  struct Joined {
    StreamId stream;
    uint64_t last;  // the last position captured there (0: none yet)
  };
  Joined* find(StreamId s) {
    for (Joined& j : streams_) {
      if (j.stream == s) return &j;
    }
    return nullptr;
  }
  const Joined* find(StreamId s) const { return const_cast<CaptureLedger*>(this)->find(s); }

  CaptureId id_;
  StreamId origin_;
  std::vector<Joined> streams_;
  std::unordered_map<uintptr_t, Use> uses_;
  std::unordered_map<uintptr_t, size_t> kept_keys_;
  std::vector<Strong> kept_;
};

// What a captured graph keeps: the items alive for its lifetime (dropped with it, or at reset())
// and what it touches, for ordering each replay like one op on the replaying stream.
template <typename Strong, typename Weak>
class CapturedGraph {
 public:
  using Ledger = CaptureLedger<Strong, Weak>;
  using Use = typename Ledger::Use;

  CapturedGraph() = default;
  explicit CapturedGraph(typename Ledger::Graph g) : kept_(std::move(g.kept)), uses_(std::move(g.uses)) {}

  size_t kept() const { return kept_.size(); }
  // f(ref, read, written) for each storage the graph touches that is still alive.
  template <typename F>
  void for_each_alive(F&& f) const {
    for (const Use& u : uses_) {
      if (!u.ref.expired()) f(u.ref, u.read, u.written);
    }
  }
  // The graph was reset (or is being destroyed): nothing is kept any more.
  void reset() {
    kept_.clear();
    uses_.clear();
  }

 private:
  std::vector<Strong> kept_;
  std::vector<Use> uses_;
};

// The captures underway in the process, by id, each with the runtime's state of it (World): a
// capture registered here holds the gate closed until it is removed. Thread-safe.
template <typename World>
class CaptureRegistry {
 public:
  explicit CaptureRegistry(QueryGate& gate) : gate_(&gate), sync_(new Sync()) {}
  ~CaptureRegistry() { delete sync_; }
  CaptureRegistry(const CaptureRegistry&) = delete;
  CaptureRegistry& operator=(const CaptureRegistry&) = delete;

  // Registers capture `id` (if it is known already, returns the one registered); the gate stays
  // paused until remove(id). `make()` builds its state.
  template <typename Make>
  std::shared_ptr<World> add(CaptureId id, Make&& make) {
    std::lock_guard<std::mutex> lock(sync_->mutex);
    auto it = sync_->worlds.find(id);
    if (it != sync_->worlds.end()) return it->second;
    std::shared_ptr<World> w = make();
    sync_->worlds.emplace(id, w);
    gate_->pause();
    size_.store(sync_->worlds.size(), std::memory_order_release);
    return w;
  }
  // The state of capture `id`; nullptr if it is not registered.
  std::shared_ptr<World> find(CaptureId id) const {
    if (size_.load(std::memory_order_acquire) == 0) return nullptr;  // (the common case)
    std::lock_guard<std::mutex> lock(sync_->mutex);
    const auto it = sync_->worlds.find(id);
    return it == sync_->worlds.end() ? nullptr : it->second;
  }
  // Capture `id` ended: unregistered, and the gate resumes (once per add). Returns its state.
  std::shared_ptr<World> remove(CaptureId id) {
    std::lock_guard<std::mutex> lock(sync_->mutex);
    auto it = sync_->worlds.find(id);
    if (it == sync_->worlds.end()) return nullptr;
    std::shared_ptr<World> w = std::move(it->second);
    sync_->worlds.erase(it);
    size_.store(sync_->worlds.size(), std::memory_order_release);
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
    std::unordered_map<CaptureId, std::shared_ptr<World>> worlds;
  };
  QueryGate* gate_;
  Sync* sync_;
  std::atomic<size_t> size_{0};
};

}  // namespace core
}  // namespace torch_pipeline
