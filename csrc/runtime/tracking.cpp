#include "tracking.h"

#include "../core/worker_pool.h"
#include "devices.h"
#include "op_facts.h"

#include <ATen/record_function.h>
#include <c10/core/Event.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <iostream>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>

namespace torch_pipeline {
namespace tracking {

struct TaskPins::State {
  explicit State(int worker) : worker_id(worker) {}
  const int worker_id;
  std::mutex mutex;
  std::condition_variable cv;
  bool released = false;
};

namespace {

using core::Position;
using core::StorageId;
using core::StreamId;
using HoldPtr = std::shared_ptr<TaskPins::State>;

// The host timelines (CPU ops on watched memory): one per thread, ids -1, -2, ... A thread's host
// position is complete when its op returns; another thread's is not known to be.
std::atomic<StreamId> g_next_host{-1};
StreamId host_stream() {
  thread_local const StreamId id = g_next_host.fetch_sub(1);
  return id;
}
bool is_host(StreamId id) {
  return id < 0;
}
constexpr size_t kEventsKept = 64;    // recorded events kept per stream, by position

// ---- process-wide switches and counters (lock-free reads on the op path) ----------------------
std::atomic<bool> g_live{false};
std::atomic<bool> g_enabled{true};
std::atomic<int64_t> g_pipelines{0};
std::atomic<int64_t> g_holds{0};       // live TaskPinss with tensors
std::atomic<int64_t> g_host_watch{0};  // CPU storages an async copy touched, not yet swept

struct Counters {
  std::atomic<uint64_t> ops{0}, launches{0}, waits{0}, events{0}, host_waits{0},
      record_streams{0}, hold_waits{0}, holds{0}, released{0};
};
Counters g_counters;

AllocatorSafety safety_from_env() {
  const char* text = std::getenv("TORCH_PIPELINE_ALLOCATOR_SAFETY");
  if (text == nullptr || *text == '\0' || std::string(text) == "keep_alive" || std::string(text) == "hold") {
    return AllocatorSafety::kKeepAlive;
  }
  if (std::string(text) == "record_stream") {
    return AllocatorSafety::kRecordStream;
  }
  std::cerr << "torch_pipeline: TORCH_PIPELINE_ALLOCATOR_SAFETY='" << text
            << "' is not 'keep_alive' or 'record_stream'; using 'keep_alive'" << std::endl;
  return AllocatorSafety::kKeepAlive;
}
std::atomic<AllocatorSafety> g_safety{safety_from_env()};

std::mutex& life_mutex() {  // serialises going live / idle
  static auto* m = new std::mutex();
  return *m;
}
std::optional<at::CallbackHandle> g_callback;  // guarded by life_mutex

std::mutex g_wait_mutex;
BlockingWait* g_blocking_wait = nullptr;  // guarded by g_wait_mutex

// ---- the state of one live period ----------------------------------------------------------
struct StreamEntry {
  StreamEntry(StreamId i, const c10::Stream& s) : id(i), stream(s) {}
  StreamId id;
  c10::Stream stream;
  // Events recorded after positions of this stream, oldest first. Not every position has one: a
  // thread records one when it leaves a stream for another (after the last op of its run there)
  // and on demand; waiting for a position uses the first event at or after it.
  std::deque<std::pair<uint64_t, std::shared_ptr<c10::Event>>> events;
  // Allocator safety by holding: storages of other streams used here, each held until the use at
  // that position is known complete (positions ascending).
  std::deque<std::pair<uint64_t, c10::Storage>> held;
  uint64_t complete = 0;  // positions up to this one are known complete
  // Positions handed out whose op has not finished launching (several threads can share a
  // stream): an event recorded now does not cover them, so it is labelled below the lowest.
  std::vector<uint64_t> in_flight;
  uint64_t launched = 0;  // the latest position handed out
  uint64_t not_done = 0;  // the newest event a poll found not complete yet ...
  uint32_t skipped = 0;   // ... and the polls since that did not query it again
};

// A few stream ids, inline (storages are used on one or two streams).
class StreamSet {
 public:
  bool contains(StreamId id) const {
    return std::find(inline_.begin(), inline_.begin() + n_, id) != inline_.begin() + n_ ||
        std::find(more_.begin(), more_.end(), id) != more_.end();
  }
  void add(StreamId id) {
    if (n_ < inline_.size()) {
      inline_[n_++] = id;
    } else {
      more_.push_back(id);
    }
  }
  void reset(StreamId id) {
    n_ = 0;
    more_.clear();
    add(id);
  }

 private:
  std::array<StreamId, 3> inline_{};
  uint8_t n_ = 0;
  std::vector<StreamId> more_;
};

struct StorageEntry {
  StorageEntry(c10::weak_intrusive_ptr<c10::StorageImpl> w, StorageId i)
      : weak(std::move(w)), id(i) {}
  c10::weak_intrusive_ptr<c10::StorageImpl> weak;  // keeps the address from being reused
  StorageId id;
  bool host_watched = false;         // a CPU storage an async copy touched
  StreamSet recorded;                // streams recorded with the allocator (record_stream)
  StreamId home = 0;                 // the stream it was allocated on, if known (made by an op)
  // Created by the op at this position (a fresh output), not yet told to the tracker: many
  // outputs are never used again, so the definition waits for the storage's next use.
  Position pending_definition;
  std::vector<HoldPtr> holds;        // tasks holding it
};

struct LiveState {
  std::mutex mutex;
  uint64_t epoch = 0;  // bumped by every reset: positions of an older epoch are meaningless
  std::unique_ptr<core::DependencyTracker> tracker = std::make_unique<core::DependencyTracker>();
  std::unordered_map<c10::Stream, std::unique_ptr<StreamEntry>> streams;
  std::unordered_map<StreamId, StreamEntry*> by_id;
  StreamId next_stream = 1;
  std::unordered_map<const c10::StorageImpl*, StorageEntry> storages;
  // The latest fresh outputs, not in `storages` yet: most die young (never used again), and then
  // cost no entry at all. One still alive when it leaves (or when it is next used) gets an entry.
  struct Young {
    const c10::StorageImpl* key;
    c10::weak_intrusive_ptr<c10::StorageImpl> weak;
    Position definition;
  };
  std::deque<Young> young;
  size_t inserted_since_sweep = 0;
  size_t held = 0;                 // storages held for allocator safety, all streams
  // Async collectives not waited for yet: their Work and the device tensors they write.
  std::deque<std::pair<const void*, std::vector<at::Tensor>>> async_works;
  size_t launches_since_poll = 0;
  // Go-live baseline: the streams current then; each stream seen for the first time waits once
  // for the baseline event of its device.
  std::vector<std::pair<c10::Stream, c10::Event>> baseline;
};

LiveState* g_state = new LiveState();  // replaced (the old one leaked) in a forked child

struct ForkHandler {
  ForkHandler() {
    pthread_atfork(nullptr, nullptr, [] { g_state = new LiveState(); });
  }
} fork_handler;

// ---- helpers (LiveState::mutex held where noted) ------------------------------------------------
const c10::impl::DeviceGuardImplInterface* guard_impl(c10::DeviceType type) {
  return c10::impl::getDeviceGuardImpl(type);
}

StreamEntry& stream_entry_locked(LiveState& st, const c10::Stream& s) {
  auto it = st.streams.find(s);
  if (it != st.streams.end()) {
    return *it->second;
  }
  auto entry = std::make_unique<StreamEntry>(st.next_stream++, s);
  for (const auto& [from, event] : st.baseline) {
    if (from.device() == s.device() && from != s) {
      event.block(s);
      g_counters.waits.fetch_add(1, std::memory_order_relaxed);
    }
  }
  StreamEntry& out = *entry;
  st.by_id.emplace(out.id, entry.get());
  st.streams.emplace(s, std::move(entry));
  return out;
}

// Drops the state of storages that died (sweeps amortised over insertions).
void maybe_sweep_locked(LiveState& st) {
  if (++st.inserted_since_sweep < std::max<size_t>(1024, st.storages.size())) {
    return;
  }
  st.inserted_since_sweep = 0;
  std::vector<StorageId> dead;
  for (auto it = st.storages.begin(); it != st.storages.end();) {
    if (it->second.weak.expired()) {
      dead.push_back(it->second.id);
      if (it->second.host_watched) {
        g_host_watch.fetch_sub(1, std::memory_order_relaxed);
      }
      it = st.storages.erase(it);
    } else {
      ++it;
    }
  }
  st.tracker->forget(dead);
}

constexpr size_t kYoung = 64;

// Gives a young storage its entry (defined by its op, allocated on that op's stream). Young
// storages have no entry (add_young_locked sees to it), so the entry is new.
StorageEntry& promote_locked(LiveState& st, LiveState::Young&& y) {
  maybe_sweep_locked(st);
  auto inserted = st.storages.emplace(
      y.key, StorageEntry(std::move(y.weak), reinterpret_cast<StorageId>(y.key)));
  StorageEntry& e = inserted.first->second;  // (new: young storages have no entry)
  e.recorded.reset(y.definition.stream);
  e.home = y.definition.stream;
  e.pending_definition = y.definition;
  return e;
}

// The young storage `key`, promoted to an entry; nullptr if it is not young.
StorageEntry* find_young_locked(LiveState& st, const c10::StorageImpl* key) {
  for (auto it = st.young.rbegin(); it != st.young.rend(); ++it) {
    if (it->key == key) {
      LiveState::Young y = std::move(*it);
      st.young.erase(std::next(it).base());
      return &promote_locked(st, std::move(y));
    }
  }
  return nullptr;
}

// A fresh output of the op at `definition`.
void add_young_locked(LiveState& st, const c10::Storage& storage, Position definition) {
  const c10::StorageImpl* key = storage.unsafeGetStorageImpl();
  auto it = st.storages.find(key);
  if (it != st.storages.end()) {
    it->second.pending_definition = definition;  // (an output of storage known already)
    it->second.recorded.reset(definition.stream);
    it->second.home = definition.stream;
    return;
  }
  for (auto& y : st.young) {
    if (y.key == key) {
      y.definition = definition;  // (two outputs sharing a storage, or an op returning it again)
      return;
    }
  }
  if (st.young.size() >= kYoung) {
    LiveState::Young oldest = std::move(st.young.front());
    st.young.pop_front();
    if (!oldest.weak.expired()) {
      promote_locked(st, std::move(oldest));
    }
  }
  st.young.push_back(LiveState::Young{key, storage.getWeakStorageImpl(), definition});
}

StorageEntry& storage_entry_locked(LiveState& st, const c10::Storage& storage) {
  const c10::StorageImpl* key = storage.unsafeGetStorageImpl();
  auto it = st.storages.find(key);
  if (it != st.storages.end()) {
    return it->second;
  }
  if (StorageEntry* e = find_young_locked(st, key)) {
    return *e;
  }
  maybe_sweep_locked(st);
  // The address is the id: the weak reference keeps it unique while the entry exists.
  return st.storages
      .emplace(key, StorageEntry(storage.getWeakStorageImpl(), reinterpret_cast<StorageId>(key)))
      .first->second;
}

// Tells the tracker about a pending definition before the storage's next use.
void define_pending_locked(LiveState& st, StorageEntry& e) {
  if (e.pending_definition.seq != 0) {
    st.tracker->define(e.pending_definition, {e.id});
    e.pending_definition = Position{};
  }
}

StorageEntry* find_storage_locked(LiveState& st, const c10::StorageImpl* key) {
  auto it = st.storages.find(key);
  if (it == st.storages.end()) {
    StorageEntry* e = find_young_locked(st, key);
    return e == nullptr || e->weak.expired() ? nullptr : e;
  }
  return it->second.weak.expired() ? nullptr : &it->second;
}

uint64_t settled(const StreamEntry& e);  // (below)

// An event recorded after position p of its stream, and how far it reaches there: the first kept
// at or after p (recorded when every position up to its label had finished launching: it reaches
// p's whole prefix; a later one is an over-wait, which is safe), else one recorded now. One
// recorded now covers every op enqueued there so far, p's included, but not a lower position that
// another thread is still launching: it reaches only the settled prefix (and p itself, which the
// tracker credits through p's clock).
struct Reach {
  std::shared_ptr<c10::Event> event;
  uint64_t reach;
};
Reach event_at_locked(LiveState& st, const Position& p) {
  StreamEntry& e = *st.by_id.at(p.stream);
  const auto it = std::lower_bound(
      e.events.begin(), e.events.end(), p.seq,
      [](const auto& entry, uint64_t seq) { return entry.first < seq; });
  if (it != e.events.end()) {
    return Reach{it->second, p.seq};
  }
  auto ev = std::make_shared<c10::Event>(e.stream.device_type());
  ev->record(e.stream);
  g_counters.events.fetch_add(1, std::memory_order_relaxed);
  return Reach{std::move(ev), std::min(p.seq, settled(e))};
}

// The latest position of `e` that every position up to has finished launching.
uint64_t settled(const StreamEntry& e) {
  uint64_t s = e.launched;
  for (const uint64_t f : e.in_flight) {
    s = std::min(s, f - 1);
  }
  return s;
}

// Records an event after position `seq` of stream `id` (the caller's op at `seq` has launched;
// the label drops below positions other threads are still launching).
void record_locked(LiveState& st, StreamId id, uint64_t seq) {
  StreamEntry& e = *st.by_id.at(id);
  seq = std::min(seq, settled(e));
  if (seq == 0 || (!e.events.empty() && e.events.back().first >= seq)) {
    return;
  }
  std::shared_ptr<c10::Event> ev;
  if (e.events.size() >= kEventsKept) {
    if (e.events.front().second.use_count() == 1) {
      ev = std::move(e.events.front().second);  // re-recorded: nobody holds it
    }
    e.events.pop_front();
  }
  if (!ev) {
    ev = std::make_shared<c10::Event>(e.stream.device_type());
  }
  ev->record(e.stream);
  e.events.emplace_back(seq, std::move(ev));
  g_counters.events.fetch_add(1, std::memory_order_relaxed);
}

// Allocator safety by holding: lets go of the storages whose uses are known complete (queries the
// event after the oldest held use of each stream; records one if the stream has none after it).
// The storages go to `released`, to be dropped once the lock is released (dropping the last
// reference frees memory).
constexpr size_t kPollEvery = 1;    // device launches between polls (a poll with nothing due is free)
constexpr uint32_t kRequery = 8;    // polls before an event found not complete is queried again

void poll_held_locked(LiveState& st, std::vector<c10::Storage>& released) {
  st.launches_since_poll = 0;
  if (st.held == 0) {
    return;
  }
  for (auto& [stream, entry] : st.streams) {
    StreamEntry& e = *entry;
    auto release_done = [&] {
      while (!e.held.empty() && e.held.front().first <= e.complete) {
        released.push_back(std::move(e.held.front().second));
        e.held.pop_front();
        --st.held;
      }
    };
    release_done();
    if (e.held.empty()) {
      continue;
    }
    // The newest event after a held use, then (if that one is not done) the oldest: at most two
    // queries per stream. Without one, record one now after all held uses (they have all
    // launched: holds are added after their op) and keep it for later polls and waits.
    const uint64_t front = e.held.front().first;
    std::vector<std::pair<uint64_t, std::shared_ptr<c10::Event>>> candidates;
    if (!e.events.empty() && e.events.back().first >= front) {
      candidates.push_back(e.events.back());
      auto it = std::lower_bound(e.events.begin(), e.events.end(), front,
                                 [](const auto& entry, uint64_t seq) { return entry.first < seq; });
      if (it->first != e.events.back().first) {
        candidates.push_back(*it);
      }
    } else {
      const uint64_t covers = std::min(e.held.back().first, settled(e));
      if (covers < front) {
        continue;  // the oldest held use is behind an op still launching on another thread
      }
      auto ev = std::make_shared<c10::Event>(e.stream.device_type());
      ev->record(e.stream);
      g_counters.events.fetch_add(1, std::memory_order_relaxed);
      if (e.events.empty() || e.events.back().first < covers) {
        e.events.emplace_back(covers, ev);
      }
      candidates.emplace_back(covers, std::move(ev));
    }
    if (candidates.front().first == e.not_done && ++e.skipped < kRequery) {
      continue;  // queried recently and not done: a device query is not free
    }
    e.skipped = 0;
    e.not_done = candidates.front().first;
    for (const auto& [covers, ev] : candidates) {
      if (ev->query()) {
        e.complete = std::max(e.complete, covers);
        st.tracker->completed(Position{e.id, covers});
        break;
      }
    }
    release_done();
  }
  g_counters.released.fetch_add(released.size(), std::memory_order_relaxed);
}

// ---- what an op touches -------------------------------------------------------------------------
struct Access {
  const at::Tensor* tensor;
  bool write;
};

bool has_data(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.storage().data() != nullptr;
}

void add_tensor(const at::Tensor& t, bool write, std::vector<Access>& out) {
  if (has_data(t)) {
    out.push_back(Access{&t, write});
  }
}

// A tensor argument goes to `out`; the tensors of a list argument go to `items` (owned copies,
// since a list hands out temporaries), with the list's write flag.
void add_ivalue(const c10::IValue& v, bool write, std::vector<Access>& out,
                std::vector<std::pair<at::Tensor, bool>>& items) {
  if (v.isTensor()) {
    add_tensor(v.toTensor(), write, out);
  } else if (v.isTensorList()) {
    for (const at::Tensor& x : v.toTensorList()) {
      items.emplace_back(x, write);
    }
  } else if (v.isOptionalTensorList()) {
    for (const std::optional<at::Tensor>& x : v.toOptionalTensorList()) {
      if (x.has_value()) {
        items.emplace_back(*x, write);
      }
    }
  } else if (v.isList()) {
    for (const c10::IValue& x : v.toListRef()) {
      if (x.isTensor()) {
        items.emplace_back(x.toTensor(), write);
      }
    }
  }
}

// Per-thread scratch of the op being observed (only the outermost one of a thread).
struct Group {
  c10::Device device;
  c10::Stream stream;
  StreamId id;
  uint64_t seq;
};

struct Tls {
  int level = 0;   // RecordFunction nesting on this thread
  int active = 0;  // level of the observed (outermost) op, 0 if none
  uint64_t epoch = 0;
  bool async = false;  // a non_blocking copy: its CPU storages are accessed on the stream
  bool host_only = false;  // the op has nothing on a device and nothing watched: no end work
  bool c10d = false;       // a c10d op (a collective): it may return a Work
  std::vector<Group> groups;
  std::vector<const c10::StorageImpl*> inputs;
  std::vector<Access> accesses;
  std::vector<std::pair<at::Tensor, bool>> list_items;  // tensors of list arguments, write flag
  std::vector<StorageId> reads, writes;
  std::vector<Access> scratch;
  std::vector<at::Tensor> fresh;
  std::vector<c10::Device> devices;
  std::vector<std::shared_ptr<c10::Event>> wait_events;  // the events a launch waits on
  // The position of this thread's last op, if its event is not recorded yet (recorded when the
  // thread launches on another stream: the end of its run of ops on that stream).
  Position last;
  uint64_t last_epoch = 0;
  // Storages of other streams the op uses (allocator safety by holding), held from its end on.
  using PendingHold = TrackScope::Hold;
  std::vector<PendingHold> pending_holds;
};
thread_local Tls tls;

// Holds that cannot be kept (tracking went idle, the op failed): record_stream instead.
void record_pending_holds(Tls& t) {
  for (const auto& h : t.pending_holds) {
    guard_impl(h.stream.device_type())->recordDataPtrOnStream(h.storage.data_ptr(), h.stream);
    g_counters.record_streams.fetch_add(1, std::memory_order_relaxed);
  }
  t.pending_holds.clear();
}

// Before this thread launches on stream `next`: the end of its run on another stream gets its event.
void end_run_locked(Tls& t, LiveState& st, StreamId next) {
  if (t.last.seq != 0 && t.last.stream != next) {
    if (t.last_epoch == st.epoch) {
      record_locked(st, t.last.stream, t.last.seq);
    }
    t.last = Position{};
  }
}

// ---- holds (tensors passed to submit) -----------------------------------------------------------
void blocking_wait(const Step& step) {
  BlockingWait wait;
  {
    std::lock_guard<std::mutex> lock(g_wait_mutex);
    if (g_blocking_wait != nullptr) {
      wait = *g_blocking_wait;
    }
  }
  if (wait) {
    wait(step);
  } else {
    while (!step(std::chrono::milliseconds(50))) {
    }
  }
}

// Writes to storages a task holds wait until the task is done (not on the task's own worker
// thread: there the task is either running, the writer itself, or not started, behind the writer).
void wait_for_holds(const std::vector<Access>& accesses) {
  if (g_holds.load(std::memory_order_acquire) == 0) {
    return;
  }
  std::vector<HoldPtr> wait;
  const int me = core::WorkerThread::current_id();
  {
    LiveState& st = *g_state;
    std::lock_guard<std::mutex> lock(st.mutex);
    for (const Access& a : accesses) {
      if (!a.write) {
        continue;
      }
      StorageEntry* e = find_storage_locked(st, a.tensor->storage().unsafeGetStorageImpl());
      if (e == nullptr || e->holds.empty()) {
        continue;
      }
      auto& holds = e->holds;
      holds.erase(std::remove_if(holds.begin(), holds.end(), [](const HoldPtr& h) {
                    std::lock_guard<std::mutex> l(h->mutex);
                    return h->released;
                  }), holds.end());
      for (const HoldPtr& h : holds) {
        if (h->worker_id != me) {
          wait.push_back(h);
        }
      }
    }
  }
  for (const HoldPtr& h : wait) {
    g_counters.hold_waits.fetch_add(1, std::memory_order_relaxed);
    blocking_wait([&h](std::chrono::milliseconds timeout) {
      std::unique_lock<std::mutex> lock(h->mutex);
      return h->cv.wait_for(lock, timeout, [&] { return h->released; });
    });
  }
}

// ---- the host path: synchronous CPU accesses of watched memory ---------------------------------
void host_access(Tls& t, const std::vector<Access>& cpu) {
  LiveState& st = *g_state;
  std::vector<std::shared_ptr<c10::Event>> events;
  std::vector<Position> waits;    // the device waits, and how far each event reaches
  std::vector<uint64_t> reaches;
  uint64_t epoch = 0;
  Position position;
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    auto& reads = t.reads;
    auto& writes = t.writes;
    reads.clear();
    writes.clear();
    for (const Access& a : cpu) {
      StorageEntry* e = find_storage_locked(st, a.tensor->storage().unsafeGetStorageImpl());
      if (e != nullptr && e->host_watched) {
        define_pending_locked(st, *e);
        (a.write ? writes : reads).push_back(e->id);
      }
    }
    if (reads.empty() && writes.empty()) {
      return;
    }
    auto launch = st.tracker->launch(host_stream(), reads, writes, [&](const Position& w) {
      if (is_host(w.stream)) {
        return w.seq;
      }
      Reach r = event_at_locked(st, w);
      events.push_back(std::move(r.event));
      reaches.push_back(r.reach);
      return r.reach;
    });
    waits.clear();
    for (const Position& w : launch.waits) {
      if (!is_host(w.stream)) {
        waits.push_back(w);
      }
    }
    position = launch.position;
    epoch = st.epoch;
  }
  for (const auto& ev : events) {
    ev->synchronize();
    g_counters.host_waits.fetch_add(1, std::memory_order_relaxed);
  }
  std::lock_guard<std::mutex> lock(st.mutex);
  if (st.epoch != epoch) {
    return;
  }
  for (size_t i = 0; i < waits.size(); ++i) {
    st.tracker->completed(waits[i], reaches[i]);
  }
  st.tracker->completed(position);  // the CPU op runs now, synchronously
}

// ---- the device path --------------------------------------------------------------------------
// Launches `accesses` (device tensors, and with async the CPU tensors of a non_blocking copy) on
// the current streams of their devices: one tracker launch per device, waits inserted. Appends
// the launched groups. `target`: the device of a non_blocking copy from the host (its first group).
void device_launch(Tls& t, const std::vector<Access>& accesses, bool async,
                   std::vector<Group>& groups, uint64_t& epoch,
                   std::optional<c10::Device> target = std::nullopt) {
  LiveState& st = *g_state;
  // The devices, in order of first appearance (a copy to `target` runs there).
  auto& devices = t.devices;
  devices.clear();
  if (target.has_value()) {
    devices.push_back(*target);
  }
  for (const Access& a : accesses) {
    const c10::Device d = a.tensor->device();
    if (!d.is_cpu() && std::find(devices.begin(), devices.end(), d) == devices.end()) {
      devices.push_back(d);
    }
  }
  const bool hold = g_safety.load(std::memory_order_relaxed) == AllocatorSafety::kKeepAlive;
  std::vector<c10::Storage> released;  // dropped after the lock (declared before it)
  std::lock_guard<std::mutex> lock(st.mutex);
  epoch = st.epoch;
  if (++st.launches_since_poll >= kPollEvery) {
    poll_held_locked(st, released);
  }
  for (size_t di = 0; di < devices.size(); ++di) {
    const c10::Device device = devices[di];
    const auto* impl = guard_impl(device.type());
    const c10::Stream stream = impl->getStream(device);
    StreamEntry& se = stream_entry_locked(st, stream);
    auto& reads = t.reads;
    auto& writes = t.writes;
    reads.clear();
    writes.clear();
    for (const Access& a : accesses) {
      const c10::Device d = a.tensor->device();
      const bool cpu_here = d.is_cpu() && async && di == 0;  // a copy's host side: its stream
      if (d != device && !cpu_here) {
        continue;
      }
      const c10::Storage& storage = a.tensor->storage();
      StorageEntry& e = storage_entry_locked(st, storage);
      define_pending_locked(st, e);
      if (cpu_here) {
        if (!e.host_watched) {
          e.host_watched = true;
          g_host_watch.fetch_add(1, std::memory_order_relaxed);
        }
      } else if (hold && e.home != 0) {
        // Allocator safety by holding: a use off the allocation stream keeps the storage alive
        // until the use completes (from the op's end on).
        if (e.home != se.id) {
          t.pending_holds.push_back(Tls::PendingHold{se.id, stream, storage});
        }
      } else if (!e.recorded.contains(se.id)) {
        // Allocator safety by record_stream (also for storages of unknown allocation stream):
        // the memory is not reused before this stream's work at free time completes (a no-op on
        // the stream the block was allocated on).
        impl->recordDataPtrOnStream(storage.data_ptr(), stream);
        e.recorded.add(se.id);
        g_counters.record_streams.fetch_add(1, std::memory_order_relaxed);
      }
      (a.write ? writes : reads).push_back(e.id);
    }
    end_run_locked(t, st, se.id);
    auto& wait_events = t.wait_events;
    wait_events.clear();
    const auto launch = st.tracker->launch(se.id, reads, writes, [&](const Position& w) {
      if (is_host(w.stream)) {  // (a host op of another thread still synchronizing: racy)
        return w.seq;
      }
      Reach r = event_at_locked(st, w);
      wait_events.push_back(std::move(r.event));
      return r.reach;
    });
    se.launched = launch.position.seq;
    se.in_flight.push_back(launch.position.seq);  // until finish()
    for (const auto& ev : wait_events) {
      ev->block(stream);
    }
    wait_events.clear();
    g_counters.launches.fetch_add(1, std::memory_order_relaxed);
    g_counters.waits.fetch_add(launch.waits.size(), std::memory_order_relaxed);
    groups.push_back(Group{device, stream, se.id, launch.position.seq});
  }
}

// The ops of `groups` have finished launching (StreamEntry::in_flight).
void settle_locked(LiveState& st, const std::vector<Group>& groups) {
  for (const Group& g : groups) {
    auto it = st.by_id.find(g.id);
    if (it != st.by_id.end()) {
      auto& f = it->second->in_flight;
      auto pos = std::find(f.begin(), f.end(), g.seq);
      if (pos != f.end()) {
        f.erase(pos);
      }
    }
  }
}

// After the op: its fresh outputs get it as their (pending) definition, its holds start, and its
// position becomes the thread's last (a multi-device op records its events at once). `groups`
// gets the groups of factory outputs appended.
void finish(Tls& t, std::vector<Group>& groups, uint64_t epoch,
            const std::vector<at::Tensor>* fresh, bool async) {
  LiveState& st = *g_state;
  std::lock_guard<std::mutex> lock(st.mutex);
  if (epoch != 0 && st.epoch != epoch) {
    record_pending_holds(t);  // tracking went idle (and maybe live again) since the launch
    return;
  }
  settle_locked(st, groups);
  if (fresh != nullptr) {
    for (const at::Tensor& out : *fresh) {
      const c10::Device d = out.device();
      size_t g = groups.size();
      if (d.is_cpu()) {
        if (!async || groups.empty()) {
          continue;  // a CPU op's output: nothing pending on it
        }
        g = 0;  // the output of a non_blocking copy to the host: written on the copy's stream
      } else {
        for (size_t i = 0; i < groups.size(); ++i) {
          if (groups[i].device == d) {
            g = i;
            break;
          }
        }
        if (g == groups.size()) {
          // A factory (no input on this device): the op ran on the device's current stream.
          const c10::Stream stream = guard_impl(d.type())->getStream(d);
          StreamEntry& se = stream_entry_locked(st, stream);
          end_run_locked(t, st, se.id);
          const auto launch = st.tracker->launch(se.id, {}, {});
          se.launched = launch.position.seq;  // (launched already: the op has run)
          g_counters.launches.fetch_add(1, std::memory_order_relaxed);
          groups.push_back(Group{d, stream, se.id, launch.position.seq});
        }
      }
      const Position definition{groups[g].id, groups[g].seq};
      if (!d.is_cpu()) {
        add_young_locked(st, out.storage(), definition);
        continue;
      }
      StorageEntry& e = storage_entry_locked(st, out.storage());  // watched host memory
      if (!e.host_watched) {
        e.host_watched = true;
        g_host_watch.fetch_add(1, std::memory_order_relaxed);
      }
      e.pending_definition = definition;
    }
  }
  for (auto& h : t.pending_holds) {
    for (const Group& g : groups) {
      if (g.id == h.id) {
        auto& held = st.by_id.at(h.id)->held;  // kept sorted (threads finish out of order)
        auto at = std::upper_bound(held.begin(), held.end(), g.seq,
                                   [](uint64_t seq, const auto& x) { return seq < x.first; });
        held.emplace(at, g.seq, std::move(h.storage));
        ++st.held;
        g_counters.holds.fetch_add(1, std::memory_order_relaxed);
        break;
      }
    }
  }
  t.pending_holds.clear();  // (under the lock: a storage not moved may be the last reference)
  if (groups.size() == 1) {
    t.last = Position{groups[0].id, groups[0].seq};  // its event waits for the end of the run
    t.last_epoch = st.epoch;
  } else {
    for (const Group& g : groups) {
      record_locked(st, g.id, g.seq);
    }
  }
}

// ---- the RecordFunction callback ----------------------------------------------------------------
void warn_once(const char* where, const std::exception& e) {
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    std::cerr << "torch_pipeline: automatic synchronization failed " << where << " ("
              << e.what() << "); this op may race. Further failures are not reported."
              << std::endl;
  }
}

// Whether an argument puts the op on a device: a device tensor (also in a list), or a device
// argument (factories, to()).
bool on_device(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& x = v.toTensor();
    return x.defined() && !x.device().is_cpu();
  }
  if (v.isDevice()) {
    return !v.toDevice().is_cpu();
  }
  if (v.isTensorList()) {
    for (const at::Tensor& x : v.toTensorList()) {
      if (x.defined() && !x.device().is_cpu()) return true;
    }
  } else if (v.isOptionalTensorList()) {
    for (const std::optional<at::Tensor>& x : v.toOptionalTensorList()) {
      if (x.has_value() && x->defined() && !x->device().is_cpu()) return true;
    }
  } else if (v.isList()) {
    for (const c10::IValue& x : v.toListRef()) {
      if (x.isTensor() && x.toTensor().defined() && !x.toTensor().device().is_cpu()) return true;
    }
  }
  return false;
}

void begin_op(const at::RecordFunction& fn, const OpFacts& facts, Tls& t) {
  t.groups.clear();
  t.inputs.clear();
  t.accesses.clear();
  t.list_items.clear();
  t.async = false;
  t.epoch = 0;
  t.c10d = facts.name.compare(0, 6, "c10d::") == 0;
  const auto inputs = fn.inputs();
  // The common case of CPU code: nothing on a device, no watched host memory, no held tensors.
  t.host_only = g_host_watch.load(std::memory_order_acquire) == 0 &&
      g_holds.load(std::memory_order_acquire) == 0 &&
      std::none_of(inputs.begin(), inputs.end(), on_device);
  if (t.host_only) {
    return;
  }
  bool any_device = false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool w = i < facts.write.size() && facts.write[i] != 0;
    add_ivalue(inputs[i], w, t.accesses, t.list_items);
  }
  // Tensors of list arguments (torch.cat, _foreach_*), added once list_items stops growing.
  for (const auto& [x, w] : t.list_items) {
    add_tensor(x, w, t.accesses);
  }
  if (t.accesses.empty()) {
    return;  // a factory: its outputs are handled at the end
  }
  for (const Access& a : t.accesses) {
    t.inputs.push_back(a.tensor->storage().unsafeGetStorageImpl());
    any_device |= !a.tensor->device().is_cpu();
  }
  const bool non_blocking = facts.non_blocking >= 0 &&
      static_cast<size_t>(facts.non_blocking) < inputs.size() &&
      inputs[facts.non_blocking].isBool() && inputs[facts.non_blocking].toBool();
  // A non_blocking copy from the host to a device (x.to("cuda", non_blocking=True)) has only CPU
  // tensors among its inputs: its device argument says where it runs.
  std::optional<c10::Device> target;
  if (non_blocking && !any_device) {
    for (const c10::IValue& v : inputs) {
      if (v.isDevice() && !v.toDevice().is_cpu()) {
        target = v.toDevice();
        if (!target->has_index()) {
          target = c10::Device(target->type(), guard_impl(target->type())->getDevice().index());
        }
        break;
      }
    }
  }
  t.async = non_blocking && (any_device || target.has_value());
  wait_for_holds(t.accesses);
  if (!t.async && (g_host_watch.load(std::memory_order_acquire) > 0 ||
                   g_holds.load(std::memory_order_acquire) > 0)) {
    t.scratch.clear();
    for (const Access& a : t.accesses) {
      if (a.tensor->device().is_cpu()) {
        t.scratch.push_back(a);
      }
    }
    if (!t.scratch.empty()) {
      host_access(t, t.scratch);
    }
  }
  if (any_device || target.has_value()) {
    device_launch(t, t.accesses, t.async, t.groups, t.epoch, target);
  }
}

constexpr size_t kAsyncWorksKept = 1024;

// A c10d op returned a Work: remember the device tensors it writes until the work is waited for.
void note_async_collective(const at::RecordFunction& fn, const Tls& t) {
  const void* work = nullptr;
  for (const c10::IValue& v : fn.outputs()) {
    if ((work = torchbind_target(v)) != nullptr) {
      break;
    }
    if (v.isTuple()) {
      for (const c10::IValue& x : v.toTupleRef().elements()) {
        if ((work = torchbind_target(x)) != nullptr) {
          break;
        }
      }
    }
    if (work != nullptr) {
      break;
    }
  }
  if (work == nullptr) {
    return;
  }
  std::vector<at::Tensor> written;
  for (const Access& a : t.accesses) {
    if (a.write && !a.tensor->device().is_cpu()) {
      written.push_back(*a.tensor);
    }
  }
  if (written.empty()) {
    return;
  }
  std::vector<at::Tensor> dropped;  // released after the lock
  LiveState& st = *g_state;
  std::lock_guard<std::mutex> lock(st.mutex);
  if (st.async_works.size() >= kAsyncWorksKept) {
    dropped = std::move(st.async_works.front().second);  // never waited for: forgotten
    st.async_works.pop_front();
  }
  st.async_works.emplace_back(work, std::move(written));
}

void end_op(const at::RecordFunction& fn, Tls& t) {
  auto& fresh = t.fresh;
  fresh.clear();
  for (const c10::IValue& v : fn.outputs()) {
    auto consider = [&](const at::Tensor& x) {
      if (has_data(x) &&
          std::find(t.inputs.begin(), t.inputs.end(), x.storage().unsafeGetStorageImpl()) ==
              t.inputs.end() &&
          (!x.device().is_cpu() || t.async)) {
        fresh.push_back(x);
      }
    };
    if (v.isTensor()) {
      consider(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& x : v.toTensorList()) {
        consider(x);
      }
    } else if (v.isList()) {
      for (const c10::IValue& x : v.toListRef()) {
        if (x.isTensor()) {
          consider(x.toTensor());
        }
      }
    } else if (v.isTuple()) {
      for (const c10::IValue& x : v.toTupleRef().elements()) {
        if (x.isTensor()) {
          consider(x.toTensor());
        }
      }
    }
  }
  if (t.c10d) {
    note_async_collective(fn, t);
  }
  if (t.groups.empty() && fresh.empty()) {
    return;
  }
  finish(t, t.groups, t.epoch, &fresh, t.async);  // (epoch 0 for a factory: the current one)
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  Tls& t = tls;
  ++t.level;
  if (t.active != 0) {
    return nullptr;  // inside an observed op: its device work is on the same streams
  }
  const OpFacts& facts = op_facts(fn);
  if (facts.transparent) {
    return nullptr;
  }
  t.active = t.level;
  g_counters.ops.fetch_add(1, std::memory_order_relaxed);
  try {
    begin_op(fn, facts, t);
  } catch (const std::exception& e) {
    if (!t.groups.empty()) {
      LiveState& st = *g_state;
      std::lock_guard<std::mutex> lock(st.mutex);
      if (st.epoch == t.epoch) {
        settle_locked(st, t.groups);
      }
    }
    t.groups.clear();
    t.host_only = true;
    warn_once("before an op", e);
  }
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  Tls& t = tls;
  if (t.level == 0) {
    return;  // the callback was installed while this op ran: its start was not seen
  }
  if (t.active == t.level) {
    t.active = 0;
    try {
      if (!t.host_only) {
        end_op(fn, t);
      }
    } catch (const std::exception& e) {
      warn_once("after an op", e);
    }
    t.groups.clear();
    t.list_items.clear();
    t.fresh.clear();
    if (!t.pending_holds.empty()) {
      record_pending_holds(t);  // (begin_op failed after choosing to hold)
    }
  }
  --t.level;
}

// ---- live / idle ---------------------------------------------------------------------------------
void reset_locked(LiveState& st) {
  ++st.epoch;
  st.tracker = std::make_unique<core::DependencyTracker>();
  st.streams.clear();
  st.by_id.clear();
  st.storages.clear();
  st.young.clear();
  st.held = 0;
  st.async_works.clear();
  st.baseline.clear();
  st.inserted_since_sweep = 0;
  g_host_watch.store(0, std::memory_order_relaxed);
}

void go_live() {
  // The callback first: ops from now on are observed; those queued before the baseline below is
  // recorded (on the streams current now and the default streams) are ordered by it.
  g_callback = at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                         .needsInputs(true)
                                         .needsOutputs(true)
                                         .scopes({at::RecordScope::FUNCTION}));
  LiveState& st = *g_state;
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    reset_locked(st);
    // Work launched before (untracked) is ordered before tracked work: each stream waits for
    // this baseline at its first use.
    for (const c10::Device& d : initialized_accelerator_devices()) {
      const auto* impl = guard_impl(d.type());
      for (const c10::Stream& s : {impl->getStream(d), impl->getDefaultStream(d)}) {
        const bool seen = std::any_of(st.baseline.begin(), st.baseline.end(),
                                      [&](const auto& b) { return b.first == s; });
        if (!seen) {
          st.baseline.emplace_back(s, c10::Event(d.type()));
          st.baseline.back().second.record(s);
        }
      }
    }
  }
  g_live.store(true, std::memory_order_release);
}

// Every tracked stream, and each device's default stream and this thread's current one, waits for
// all tracked work of its device: untracked work from now on is ordered after it.
void barrier_locked(LiveState& st) {
  std::vector<std::pair<c10::Stream, c10::Event>> ends;
  std::vector<c10::Stream> waiters;
  for (const auto& [stream, entry] : st.streams) {
    ends.emplace_back(stream, c10::Event(stream.device_type()));
    ends.back().second.record(stream);
    waiters.push_back(stream);
    const auto* impl = guard_impl(stream.device_type());
    for (const c10::Stream& s : {impl->getDefaultStream(stream.device()),
                                 impl->getStream(stream.device())}) {
      if (std::find(waiters.begin(), waiters.end(), s) == waiters.end()) {
        waiters.push_back(s);
      }
    }
  }
  for (const c10::Stream& stream : waiters) {
    for (const auto& [from, event] : ends) {
      if (from != stream && from.device() == stream.device()) {
        event.block(stream);
      }
    }
  }
}

// Held storages, whose uses may still run, go to the allocator's record_stream instead; they are
// moved to `released`, to be dropped after the lock.
void hand_held_to_allocator_locked(LiveState& st, std::vector<c10::Storage>& released) {
  for (auto& [stream, entry] : st.streams) {
    for (auto& [seq, storage] : entry->held) {
      guard_impl(stream.device_type())->recordDataPtrOnStream(storage.data_ptr(), stream);
      released.push_back(std::move(storage));
    }
    entry->held.clear();
  }
  st.held = 0;
}

void go_idle() {
  g_live.store(false, std::memory_order_release);
  LiveState& st = *g_state;
  std::vector<std::shared_ptr<c10::Event>> host_pending;
  std::vector<c10::Storage> released;
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    barrier_locked(st);
    // CPU memory a non_blocking copy may still be writing: CPU ops will no longer be observed, so
    // wait here for the copies (on the streams that touched watched memory).
    std::vector<StreamId> touched;
    for (auto& [key, e] : st.storages) {
      if (!e.host_watched || e.weak.expired()) {
        continue;
      }
      define_pending_locked(st, e);
      for (const Position& p : st.tracker->uses_off(e.id, host_stream())) {
        if (!is_host(p.stream) &&
            std::find(touched.begin(), touched.end(), p.stream) == touched.end()) {
          touched.push_back(p.stream);
        }
      }
    }
    for (const StreamId id : touched) {
      const auto it = st.by_id.find(id);
      if (it != st.by_id.end()) {
        host_pending.push_back(std::make_shared<c10::Event>(it->second->stream.device_type()));
        host_pending.back()->record(it->second->stream);
      }
    }
    hand_held_to_allocator_locked(st, released);
  }
  for (const auto& ev : host_pending) {
    ev->synchronize();
  }
  if (g_callback.has_value()) {
    at::removeCallback(*g_callback);
    g_callback.reset();
  }
  {
    // Again, for what other threads launched while the callback was still installed.
    std::lock_guard<std::mutex> lock(st.mutex);
    barrier_locked(st);
    hand_held_to_allocator_locked(st, released);
    reset_locked(st);
  }
  released.clear();  // after the lock: may free memory
}

void update_live() {
  std::lock_guard<std::mutex> lock(life_mutex());
  const bool want = g_enabled.load() &&
      (g_pipelines.load() > 0 || g_holds.load() > 0);
  if (want == g_live.load()) {
    return;
  }
  if (want) {
    go_live();
  } else {
    go_idle();
  }
}

// Groups of accesses by device for TrackScope (no RecordFunction involved).
void split_cpu(const std::vector<Access>& all, std::vector<Access>& cpu) {
  cpu.clear();
  for (const Access& a : all) {
    if (a.tensor->device().is_cpu()) {
      cpu.push_back(a);
    }
  }
}

}  // namespace

void pipeline_created() {
  if (g_pipelines.fetch_add(1) == 0) {
    update_live();
  }
}

void pipeline_destroyed() {
  if (g_pipelines.fetch_sub(1) == 1) {
    update_live();
  }
}

bool live() {
  return g_live.load(std::memory_order_acquire);
}

void set_enabled(bool enabled) {
  g_enabled.store(enabled);
  update_live();
}

bool enabled() {
  return g_enabled.load();
}

Stats stats() {
  Stats s;
  s.live = live();
  s.ops = g_counters.ops.load();
  s.launches = g_counters.launches.load();
  s.waits = g_counters.waits.load();
  s.events = g_counters.events.load();
  s.host_waits = g_counters.host_waits.load();
  s.record_streams = g_counters.record_streams.load();
  s.pin_waits = g_counters.hold_waits.load();
  s.keep_alives = g_counters.holds.load();
  s.released = g_counters.released.load();
  LiveState& st = *g_state;
  std::lock_guard<std::mutex> lock(st.mutex);
  s.storages = st.tracker->num_storages();
  s.kept_alive = st.held;
  s.streams = st.streams.size();
  return s;
}

void work_waited(const void* work) {
  if (!live() || work == nullptr) {
    return;
  }
  std::vector<at::Tensor> written;
  {
    LiveState& st = *g_state;
    std::lock_guard<std::mutex> lock(st.mutex);
    auto& works = st.async_works;
    auto it = std::find_if(works.begin(), works.end(),
                           [&](const auto& w) { return w.first == work; });
    if (it == works.end()) {
      return;
    }
    written = std::move(it->second);
    works.erase(it);
  }
  // The current streams have waited for the work: its tensors are written there, now.
  TrackScope scope({}, written);
}

void set_allocator_safety(AllocatorSafety safety) {
  g_safety.store(safety);
}

AllocatorSafety allocator_safety() {
  return g_safety.load();
}

void poll() {
  if (!live()) {
    return;
  }
  LiveState& st = *g_state;
  std::vector<c10::Storage> released;
  std::lock_guard<std::mutex> lock(st.mutex);
  poll_held_locked(st, released);
  // (released is destroyed after the lock: declared before it)
}

void set_blocking_wait(BlockingWait wait) {
  std::lock_guard<std::mutex> lock(g_wait_mutex);
  delete g_blocking_wait;
  g_blocking_wait = wait ? new BlockingWait(std::move(wait)) : nullptr;
}

// ---- TrackScope ------------------------------------------------------------------------------------
TrackScope::TrackScope(const std::vector<at::Tensor>& reads, const std::vector<at::Tensor>& writes) {
  if (!live()) {
    return;
  }
  std::vector<Access> accesses;
  for (const at::Tensor& t : reads) {
    add_tensor(t, false, accesses);
  }
  for (const at::Tensor& t : writes) {
    add_tensor(t, true, accesses);
  }
  wait_for_holds(accesses);
  std::vector<Access> cpu;
  split_cpu(accesses, cpu);
  if (!cpu.empty() && (g_host_watch.load() > 0 || g_holds.load() > 0)) {
    host_access(tls, cpu);
  }
  if (cpu.size() == accesses.size()) {
    return;
  }
  std::vector<Group> groups;
  Tls& t = tls;
  device_launch(t, accesses, /*async=*/false, groups, epoch_);
  for (const Group& g : groups) {
    launched_.push_back(Launched{g.stream, g.id, g.seq});
  }
  // The scope's holds are its own (ops inside the block must not take them).
  holds_ = std::move(t.pending_holds);
  t.pending_holds.clear();
}

TrackScope::~TrackScope() {
  if (launched_.empty()) {
    return;
  }
  std::vector<Group> groups;
  for (const Launched& l : launched_) {
    groups.push_back(Group{l.stream.device(), l.stream, l.id, l.seq});
  }
  Tls& t = tls;
  t.pending_holds = std::move(holds_);
  try {
    finish(t, groups, epoch_, nullptr, false);
  } catch (const std::exception& e) {
    warn_once("at the end of tp.track", e);
  }
}

// ---- TaskPins ---------------------------------------------------------------------------------------
TaskPins::TaskPins(const std::vector<at::Tensor>& tensors, int worker_id) {
  std::vector<const at::Tensor*> held;
  for (const at::Tensor& t : tensors) {
    if (has_data(t)) {
      held.push_back(&t);
    }
  }
  if (held.empty() || !g_enabled.load()) {
    return;
  }
  state_ = std::make_shared<State>(worker_id);
  g_holds.fetch_add(1);
  update_live();  // (every time: another thread's go_live may not have run yet)
  LiveState& st = *g_state;
  std::lock_guard<std::mutex> lock(st.mutex);
  for (const at::Tensor* t : held) {
    storage_entry_locked(st, t->storage()).holds.push_back(state_);
  }
}

TaskPins::~TaskPins() {
  release();
}

void TaskPins::release() {
  if (!state_) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->released) {
      return;
    }
    state_->released = true;
  }
  state_->cv.notify_all();
  if (g_holds.fetch_sub(1) == 1) {
    try {
      update_live();
    } catch (const std::exception& e) {  // (called from noexcept task paths)
      warn_once("when the last task holding tensors ended", e);
    }
  }
}

}  // namespace tracking
}  // namespace torch_pipeline
