// The host-watch module (see host_watch.h): CPU memory of non_blocking copies, the host waits of
// CPU ops that touch it, and the wait for pending copies when going idle. Touches
// StorageData::host_watched, g_host_watch, and host positions of the core tracker.
#include "host_watch.h"

#include "../capture_probe.h"
#include "../warn.h"
#include "graph_capture.h"
#include "storages.h"
#include "streams.h"

#include <algorithm>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// The one place that changes StorageData's host-watch field.
struct HostWatchAccess {
  static void watch(StorageData& d) { d.host_watched_ = true; }
};

void watch_locked(StorageEntry& e) {
  if (!e.data.host_watched()) {
    HostWatchAccess::watch(e.data);
    g_host_watch.fetch_add(1, std::memory_order_relaxed);
  }
}

void host_access(const std::vector<Access>& cpu, std::vector<StorageId>& reads,
                 std::vector<StorageId>& writes) {
  LiveState& st = state();
  std::vector<std::shared_ptr<c10::Event>> events;
  std::vector<Position> waits;  // the device waits, and how far each event reaches
  std::vector<uint64_t> reaches;
  uint64_t period = 0;
  Position position;
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    reads.clear();
    writes.clear();
    for (const Access& a : cpu) {
      StorageEntry* e = find_storage_locked(st, a.tensor->storage().unsafeGetStorageImpl());
      if (e != nullptr && e->data.host_watched()) {
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
    for (const Position& w : launch.waits) {
      if (!is_host(w.stream)) {
        waits.push_back(w);
      }
    }
    position = launch.position;
    period = st.period;
  }
  // Held while the host waits: a capture about to begin waits for the end of the waits first.
  // (No lock is held here, so taking it may wait for such a begin to drain the queries.)
  const core::QueryGate::Permit permit =
      events.empty() ? core::QueryGate::Permit() : query_gate().permit();
  if (!events.empty() && !permit) {
    // A graph capture is underway: no synchronization is allowed in the process, so the copy is
    // not waited for (nor known complete).
    count(&Counters::polls_paused);
    warn_once("host wait during capture",
              "a CPU op touches memory that a non_blocking copy reads or writes while a graph "
              "capture is underway, when no device synchronization is allowed: it was not "
              "waited for, so it may see the memory before the copy has run. Touch it after "
              "the capture ends.");
    return;
  }
  for (const auto& ev : events) {
    try {
      ev->synchronize();
    } catch (const c10::Error& error) {
      explain_failed_query("a host wait for a non_blocking copy", error, period);
      return;  // (not waited for, nor known complete)
    }
    count(&Counters::host_waits);
  }
  std::lock_guard<std::mutex> lock(st.mutex);
  if (st.period != period) {
    return;
  }
  for (size_t i = 0; i < waits.size(); ++i) {
    st.tracker->completed(waits[i], reaches[i]);
  }
  st.tracker->completed(position);  // the CPU op runs now, synchronously
}

void pending_copies_locked(LiveState& st, std::vector<std::shared_ptr<c10::Event>>& out) {
  std::vector<StreamId> touched;
  st.storages.for_each_alive([&](StorageEntry& e) {
    if (!e.data.host_watched()) {
      return;
    }
    define_pending_locked(st, e);
    for (const Position& p : st.tracker->uses_off(e.id, host_stream())) {
      if (!is_host(p.stream) &&
          std::find(touched.begin(), touched.end(), p.stream) == touched.end()) {
        touched.push_back(p.stream);
      }
    }
  });
  for (const StreamId id : touched) {
    if (StreamEntry* se = st.streams.find(id)) {
      out.push_back(std::make_shared<c10::Event>(se->stream.device_type()));
      out.back()->record(se->stream);
    }
  }
}

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
