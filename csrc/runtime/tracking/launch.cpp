// The launch room (see launch.h): an op's launch on its device streams and its end. Owns the
// per-thread ThreadRun; touches LiveState through the stream log, storage table, keep-alive and
// host-watch rooms, and the launch/wait/event counters.
#include "launch.h"

#include "capture.h"
#include "host_watch.h"
#include "keep_alive.h"
#include "storages.h"
#include "streams.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>

namespace torch_pipeline {
namespace tracking {
namespace detail {

namespace {

thread_local ThreadRun t_run;

// Before this thread launches on stream `next`: the end of its run on another stream gets its
// event.
void end_run_locked(ThreadRun& run, LiveState& st, StreamId next) {
  if (run.last.seq != 0 && run.last.stream != next) {
    if (run.last_period == st.period) {
      record_locked(st, run.last.stream, run.last.seq);
    }
    run.last = Position{};
  }
}

void settle_locked(LiveState& st, const std::vector<Launched>& launched) {
  for (const Launched& l : launched) {
    if (StreamEntry* se = st.streams.find(l.id)) {
      se->log.finish(l.seq);
    }
  }
}

}  // namespace

ThreadRun& thread_run() { return t_run; }

void enter_streams(const std::vector<c10::Device>& devices) {
  if (devices.empty() || world_for_launch(devices)) {
    return;  // (a capture's streams live in its own world, which has no baseline)
  }
  LiveState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  for (const c10::Device& d : devices) {
    st.streams.acquire(c10::impl::getDeviceGuardImpl(d.type())->getStream(d));
  }
}

void device_launch(ThreadRun& run, const std::vector<Access>& accesses, bool async,
                   std::vector<Launched>& launched, uint64_t& period,
                   std::optional<c10::Device> target) {
  LiveState& main = state();
  // The devices, in order of first appearance (a copy to `target` runs there).
  auto& devices = run.devices;
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
  const bool keep_alive = keeping_alive();
  // During a graph capture the op is captured: it launches in the capture's own state.
  const WorldPtr world = world_for_launch(devices);
  LiveState& st = world ? world->st : main;
  std::vector<c10::Storage> released;  // dropped after the lock (declared before it)
  std::lock_guard<std::mutex> lock(st.mutex);
  period = st.period;
  if (!world) {
    maybe_poll_locked(st, released);
  }
  for (size_t di = 0; di < devices.size(); ++di) {
    const c10::Device device = devices[di];
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
    StreamEntry& se = st.streams.acquire(stream);
    if (world) {
      join_world_locked(*world, se);
    }
    auto& reads = run.reads;
    auto& writes = run.writes;
    auto& home_uses = run.home_uses;
    reads.clear();
    writes.clear();
    home_uses.clear();
    for (const Access& a : accesses) {
      const c10::Device d = a.tensor->device();
      const bool cpu_here = d.is_cpu() && async && di == 0;  // a copy's host side: its stream
      if (d != device && !cpu_here) {
        continue;
      }
      const c10::Storage& storage = a.tensor->storage();
      const c10::StorageImpl* key = storage.unsafeGetStorageImpl();
      // Note [Home-stream uses]: a storage made on this stream and used only here so far needs no
      // wait and no allocator protection; its use is noted after the launch. (Not in a capture,
      // not for a write that may give it new memory: those need its entry.)
      StreamId pending_home = 0;
      StorageEntry* found = st.storages.lookup(key, &pending_home);
      if (!world && !cpu_here && !(a.write && a.may_move) && pending_home == se.id) {
        home_uses.push_back(ThreadRun::HomeUse{key, found, a.write});
        continue;
      }
      StorageEntry& e = found != nullptr ? *found : acquire_storage_locked(st, storage);
      define_pending_locked(st, e);
      if (world) {
        capture_use_locked(*world, se, storage,
                           a.write);  // (perhaps kept for the graph's lifetime)
      } else if (cpu_here) {
        watch_locked(e);
      } else {
        protect_use_locked(e, se, storage, keep_alive, run.keep_alive);
        if (a.write && a.may_move) {
          protect_old_block_locked(e, se, storage);
        }
      }
      (a.write ? writes : reads).push_back(e.id);
    }
    // A storage also reached by another access of this op (which told the tracker its state) is
    // told to the tracker with the op's other accesses.
    // (Only those change a storage's pending state here: it is then in reads or writes.)
    if (!home_uses.empty() && (!reads.empty() || !writes.empty())) {
      home_uses.erase(
          std::remove_if(home_uses.begin(), home_uses.end(),
                         [&](const ThreadRun::HomeUse& u) {
                           const StorageId id = StorageTable::id_of(u.key);
                           if (std::find(reads.begin(), reads.end(), id) == reads.end() &&
                               std::find(writes.begin(), writes.end(), id) == writes.end()) {
                             return false;
                           }
                           (u.write ? writes : reads).push_back(id);
                           return true;
                         }),
          home_uses.end());
    }
    end_run_locked(run, st, se.id);
    auto& wait_events = run.wait_events;
    wait_events.clear();
    const auto launch = st.tracker->launch(se.id, reads, writes, [&](const Position& w) {
      if (is_host(w.stream)) {  // (a host op of another thread still synchronizing: racy)
        return w.seq;
      }
      Reach r = event_at_locked(st, w);
      wait_events.push_back(std::move(r.event));
      return r.reach;
    });
    se.log.start(launch.position.seq);  // in flight until finish()
    for (const ThreadRun::HomeUse& u : home_uses) {
      // (an entry stays where it is; a young storage may have moved in the ring)
      if (u.entry != nullptr) {
        u.entry->home_uses.note(launch.position.seq, u.write);
      } else {
        st.storages.note_home_use(u.key, launch.position.seq, u.write);
      }
    }
    for (const auto& ev : wait_events) {
      ev->block(stream);
    }
    wait_events.clear();
    count(&Counters::launches);
    count(&Counters::waits, launch.waits.size());
    if (world) {
      world->ledger.launched(se.id, launch.position.seq);
    } else if (!launch.waits.empty()) {
      release_ordered_locked(st, se, launch.waits, released);
    }
    launched.push_back(Launched{stream, se.id, launch.position.seq});
  }
}

namespace {
// The state an op launched in (period: its launch's; 0: none yet, then the world of `devices`):
// the main one, a capture's (held by `world`), or nullptr once that capture has ended.
LiveState* launch_state(uint64_t period, WorldPtr& world, const std::vector<c10::Device>& devices) {
  if (is_capture_period(period)) {
    world = world_of_period(period);
    return world ? &world->st : nullptr;
  }
  if (period == 0 && !devices.empty()) {
    world = world_for_launch(devices);
    if (world) {
      return &world->st;
    }
  }
  return &state();
}
}  // namespace

void settle(const std::vector<Launched>& launched, uint64_t period) {
  WorldPtr world;
  LiveState* st_or_null = launch_state(period, world, {});
  if (st_or_null == nullptr) {
    return;
  }
  LiveState& st = *st_or_null;
  std::lock_guard<std::mutex> lock(st.mutex);
  if (st.period == period) {
    settle_locked(st, launched);
  }
}

void finish(ThreadRun& run, std::vector<Launched>& launched, uint64_t period,
            const std::vector<at::Tensor>* fresh, bool async,
            const std::vector<at::Tensor>* moved) {
  WorldPtr world;
  std::vector<c10::Device> factory_devices;  // (a factory: where its outputs are)
  if (period == 0 && fresh != nullptr) {
    for (const at::Tensor& out : *fresh) {
      if (!out.device().is_cpu()) {
        factory_devices.push_back(out.device());
      }
    }
  }
  LiveState* st_or_null = launch_state(period, world, factory_devices);
  if (st_or_null == nullptr) {
    record_instead(run.keep_alive);  // the capture it launched in has ended
    return;
  }
  LiveState& st = *st_or_null;
  std::lock_guard<std::mutex> lock(st.mutex);
  if (period != 0 && st.period != period) {
    record_instead(run.keep_alive);  // tracking went idle (and maybe live again) since the launch
    return;
  }
  settle_locked(st, launched);
  if (moved != nullptr && !world) {
    for (const at::Tensor& m : *moved) {
      for (const Launched& l : launched) {
        if (l.device() == m.device()) {
          if (StorageEntry* e = find_storage_locked(st, m.storage().unsafeGetStorageImpl())) {
            e->moved_to(l.id);  // (else a use off the new home would not be kept alive)
          }
          break;
        }
      }
    }
  }
  if (fresh != nullptr) {
    for (const at::Tensor& out : *fresh) {
      const c10::Device d = out.device();
      size_t g = launched.size();
      if (d.is_cpu()) {
        if (!async || launched.empty()) {
          continue;  // a CPU op's output: nothing pending on it
        }
        g = 0;  // the output of a non_blocking copy to the host: written on the copy's stream
      } else {
        for (size_t i = 0; i < launched.size(); ++i) {
          if (launched[i].device() == d) {
            g = i;
            break;
          }
        }
        if (g == launched.size()) {
          // A factory (no input on this device): the op ran on the device's current stream.
          const c10::Stream stream = c10::impl::getDeviceGuardImpl(d.type())->getStream(d);
          StreamEntry& se = st.streams.acquire(stream);
          if (world) {
            join_world_locked(*world, se);
          }
          end_run_locked(run, st, se.id);
          const auto launch = st.tracker->launch(se.id, {}, {});
          se.log.note_launched(launch.position.seq);  // (launched already: the op has run)
          if (world) {
            world->ledger.launched(se.id, launch.position.seq);
          }
          count(&Counters::launches);
          launched.push_back(Launched{stream, se.id, launch.position.seq});
        }
      }
      const Position definition{launched[g].id, launched[g].seq};
      if (world) {
        capture_output_locked(*world, out.storage(), definition.stream);  // born in the graph
        if (d.is_cpu()) {
          continue;  // (host memory is not watched for a capture: the copy runs at replays)
        }
      }
      if (!d.is_cpu()) {
        add_young_locked(st, out.storage(), definition);
        continue;
      }
      StorageEntry& e = acquire_storage_locked(st, out.storage());  // watched host memory
      watch_locked(e);
      e.pending_definition = definition;
    }
  }
  start_keep_alive_locked(st, run.keep_alive, launched);
  if (launched.size() == 1) {
    run.last = Position{launched[0].id, launched[0].seq};  // its event waits for the end of the run
    run.last_period = st.period;
  } else {
    for (const Launched& l : launched) {
      record_locked(st, l.id, l.seq);
    }
  }
}

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
