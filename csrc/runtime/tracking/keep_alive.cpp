// The keep-alive module (see keep_alive.h): allocator safety by keeping alive or record_stream,
// the polling that lets kept storages go, and the mode switch. Changes LiveState::kept (through
// its methods), StorageEntry::recorded, and events via streams.h.
#include "keep_alive.h"

#include "../capture_probe.h"
#include "../settings.h"
#include "graph_capture.h"
#include "storages.h"
#include "streams.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <mutex>

namespace torch_pipeline {
namespace tracking {
namespace detail {

namespace {

constexpr size_t kPollEvery = 1;  // device launches between polls (a poll with nothing due is free)

// -1: not read yet; else an AllocatorSafety.
std::atomic<int> g_safety{-1};

AllocatorSafety safety_from_env() {
  const std::string mode = settings::env_choice(
      "TORCH_PIPELINE_ALLOCATOR_SAFETY", {"keep_alive", "record_stream", "hold"}, "keep_alive");
  return mode == "record_stream" ? AllocatorSafety::kRecordStream : AllocatorSafety::kKeepAlive;
}

AllocatorSafety safety() {
  int s = g_safety.load(std::memory_order_relaxed);
  if (s < 0) {
    int unread = -1;
    const int read = static_cast<int>(safety_from_env());  // (throws ValueError on a bad value)
    g_safety.compare_exchange_strong(unread, read);
    s = g_safety.load();
  }
  return static_cast<AllocatorSafety>(s);
}

void record_stream(const c10::Stream& stream, const c10::Storage& storage) {
  c10::impl::getDeviceGuardImpl(stream.device_type())
      ->recordDataPtrOnStream(storage.data_ptr(), stream);
  count(&Counters::record_streams);
}

}  // namespace

bool keeping_alive() { return safety() == AllocatorSafety::kKeepAlive; }

void protect_use_locked(StorageEntry& e, StreamEntry& se, const c10::Storage& storage,
                        bool keep_alive, std::vector<PendingKeepAlive>& pending) {
  if (keep_alive && e.home != 0) {
    // A use off the allocation stream keeps the storage alive until the use completes (from the
    // op's end on).
    if (e.home != se.id) {
      pending.push_back(PendingKeepAlive{se.id, se.stream, storage});
    }
  } else if (!e.recorded.contains(se.id)) {
    // record_stream (also for storages of unknown allocation stream): the memory is not reused
    // before this stream's work at free time completes (a no-op on the allocation stream).
    record_stream(se.stream, storage);
    e.recorded.add(se.id);
  }
}

void adopt_locked(const StreamEntry& se, const c10::Storage& storage) {
  record_stream(se.stream, storage);
}

void protect_old_block_locked(StorageEntry& e, const StreamEntry& se, const c10::Storage& storage) {
  // Once per block and stream: the allocator remembers a record until the block is freed, and a
  // reallocation (moved_to) resets the set for the new block.
  if (e.home != se.id && storage.data() != nullptr && !e.recorded.contains(se.id)) {
    record_stream(se.stream, storage);
    e.recorded.add(se.id);
  }
}

void start_keep_alive_locked(LiveState& st, std::vector<PendingKeepAlive>& pending,
                             const std::vector<Launched>& launched) {
  for (PendingKeepAlive& k : pending) {
    for (const Launched& l : launched) {
      if (l.id == k.id) {
        st.kept.add(k.id, l.seq, std::move(k.storage));
        count(&Counters::keep_alives);
        break;
      }
    }
  }
  pending.clear();  // (under the lock: a storage not moved may be the last reference)
}

void record_instead(std::vector<PendingKeepAlive>& pending) {
  for (const PendingKeepAlive& k : pending) {
    record_stream(k.stream, k.storage);
  }
  pending.clear();
}

void maybe_poll_locked(LiveState& st, std::vector<c10::Storage>& released) {
  if (st.kept.launch_makes_poll_due(kPollEvery)) {
    poll_locked(st, released);
  }
}

// Queries the event after the oldest kept use of each stream (and the newest, first); records one
// if the stream has none after it. Nothing while a graph capture is underway in the process, or
// about to begin (docs/design.md, "Graph capture"): the kept storages wait for the next poll
// after it. A query that fails (a capture begun without the hooks) is warned about.
void poll_locked(LiveState& st, std::vector<c10::Storage>& released) {
  st.kept.polled();
  if (st.kept.size() == 0) {
    return;
  }
  // (never blocks: the state's lock is held)
  const core::QueryGate::Permit permit = query_gate().try_permit();
  if (!permit) {
    count(&Counters::polls_paused);  // a graph capture is underway: no event may be queried
    return;
  }
  const size_t before = released.size();
  bool failed = false;
  st.kept.for_each([&](KeptStorages::OnStream& kept) {
    if (failed) {
      return;
    }
    StreamEntry& e = st.streams.at(kept.stream());
    kept.take_done(released);
    if (kept.empty()) {
      return;
    }
    // The newest event after a kept use, then (if that one is not done) the oldest: at most two
    // queries per stream. Without one, record one now after all kept uses (they have all
    // launched: keep-alives start after their op) and keep it for later polls and waits.
    // (Pointers into the stream log, which nothing below changes: no copies, no allocation.)
    using Kept = std::pair<uint64_t, std::shared_ptr<c10::Event>>;
    const uint64_t front = kept.front_seq();
    const Kept* candidates[2] = {nullptr, nullptr};
    const Kept* newest = e.log.newest();
    if (newest != nullptr && newest->first >= front) {
      candidates[0] = newest;
      const Kept* oldest = e.log.event_at(front);
      if (oldest->first != newest->first) {
        candidates[1] = oldest;
      }
    } else {
      const uint64_t covers = std::min(kept.back_seq(), e.log.settled());
      if (covers < front) {
        return;  // the oldest kept use is behind an op still launching on another thread
      }
      auto ev = std::make_shared<c10::Event>(e.stream.device_type());
      ev->record(e.stream);
      count(&Counters::events);
      // (newer than the newest kept, which is older than `front`: it becomes the newest)
      const bool recorded = e.log.keep(covers, std::move(ev));
      TORCH_INTERNAL_ASSERT(recorded && e.log.newest()->first == covers);
      candidates[0] = e.log.newest();
    }
    if (!kept.due(candidates[0]->first)) {
      return;  // queried recently and not done: a device query is not free
    }
    for (const Kept* c : candidates) {
      if (c == nullptr) {
        break;
      }
      bool done = false;
      try {
        done = c->second->query();
      } catch (const c10::Error& error) {
        explain_failed_query("a keep-alive poll's event query", error, st.period);
        failed = true;  // (kept until a later poll)
        break;
      }
      if (done) {
        kept.completed(c->first);
        st.tracker->completed(Position{e.id, c->first});
        break;
      }
    }
    if (!failed) {
      kept.take_done(released);
    }
  });
  count(&Counters::released, released.size() - before);
}

void release_ordered_locked(LiveState& st, const StreamEntry& waiter,
                            const std::vector<Position>& waited,
                            std::vector<c10::Storage>& released) {
  if (st.kept.size() == 0) {
    return;
  }
  const size_t before = released.size();
  for (const Position& w : waited) {
    std::optional<KeptStorages::OnStream> used = st.kept.on(w.stream);
    if (!used || used->front_seq() > w.seq) {
      continue;
    }
    used->take_if(
        w.seq,
        [&](uint64_t seq, const c10::Storage& storage) {
          const StorageEntry* e = find_storage_locked(st, storage.unsafeGetStorageImpl());
          return e != nullptr && e->home == waiter.id &&
                 st.tracker->is_ordered(waiter.id, Position{w.stream, seq});
        },
        released);
  }
  count(&Counters::released, released.size() - before);
}

void hand_to_allocator_locked(LiveState& st, std::vector<c10::Storage>& released) {
  st.kept.take_all(released, [&](StreamId id, c10::Storage& storage) {
    const c10::Stream s = st.streams.at(id).stream;
    c10::impl::getDeviceGuardImpl(s.device_type())->recordDataPtrOnStream(storage.data_ptr(), s);
  });
}

}  // namespace detail

void set_allocator_safety(AllocatorSafety safety) {
  detail::g_safety.store(static_cast<int>(safety));
}

AllocatorSafety allocator_safety() { return detail::safety(); }

void poll() {
  using namespace detail;
  if (!live()) {
    return;
  }
  LiveState& st = state();
  std::vector<c10::Storage> released;  // dropped after the lock (declared before it)
  std::lock_guard<std::mutex> lock(st.mutex);
  poll_locked(st, released);
}

}  // namespace tracking
}  // namespace torch_pipeline
