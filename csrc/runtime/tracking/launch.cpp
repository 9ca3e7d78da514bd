// The launch module (see launch.h): an op's launch on its device streams and its end. Owns the
// per-thread ThreadRun; touches LiveState through the stream log, storage table, keep-alive and
// host-watch modules, and the launch/wait/event counters.
#include "launch.h"

#include "graph_capture.h"
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
  if (devices.empty() || capture_for_launch(devices)) {
    return;  // (a capture's streams live in its own state, which has no baseline)
  }
  LiveState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  for (const c10::Device& d : devices) {
    st.streams.acquire(c10::impl::getDeviceGuardImpl(d.type())->getStream(d));
  }
}

namespace {

// Note [Launch targets]: an op launches into one of two targets, which share the launch below
// (device_launch, finish) and differ in what entering a stream, a use, a launch and a fresh output
// mean. The eager target is the main state: the op runs now, so a storage used off its home stream
// is protected from the allocator, watched host memory is noted, and a wait can let kept storages
// go. The capture target (graph_capture.h) is the state of a capture underway: the op is captured
// into a graph, so a stream joins the capture, a use goes to the graph's ledger, and nothing is
// polled. The launch is
// a template over the target: the eager path has no capture branch.
class EagerTarget {
 public:
  static constexpr bool kHomeUses = true;  // (Note [Home-stream uses])
  EagerTarget(LiveState& st, ThreadRun& run) : st_(st), run_(run) {}
  LiveState& state() { return st_; }
  void before_launch(std::vector<c10::Storage>& released) { maybe_poll_locked(st_, released); }
  void enter(StreamEntry&) {}
  void use(StorageEntry& e, StreamEntry& se, const c10::Storage& storage, const Access& a,
           bool cpu_here) {
    if (cpu_here) {
      watch_locked(e);
      return;
    }
    protect_use_locked(e, se, storage, keep_alive_, run_.keep_alive);
    if (a.write && a.may_move) {
      protect_old_block_locked(e, se, storage);
    }
  }
  void launched(StreamEntry& se, const core::DependencyTracker::Launch& launch,
                std::vector<c10::Storage>& released) {
    if (!launch.waits.empty()) {
      release_ordered_locked(st_, se, launch.waits, released);
    }
  }
  void factory_launched(StreamEntry&, uint64_t) {}
  size_t adopt(const StreamEntry& se, const c10::Storage& storage) {
    adopt_locked(se, storage);
    return adopt_storage_locked(st_, storage, se.id);
  }
  void moved(const std::vector<at::Tensor>& moved, const std::vector<Launched>& launched) {
    for (const at::Tensor& m : moved) {
      for (const Launched& l : launched) {
        if (l.device() == m.device()) {
          if (StorageEntry* e = find_storage_locked(st_, m.storage().unsafeGetStorageImpl())) {
            e->moved_to(l.id);  // (else a use off the new home would not be kept alive)
          }
          break;
        }
      }
    }
  }
  void output(const at::Tensor& out, Position definition) {
    if (!out.device().is_cpu()) {
      add_young_locked(st_, out.storage(), definition);
      return;
    }
    StorageEntry& e = acquire_storage_locked(st_, out.storage());  // watched host memory
    watch_locked(e);
    e.pending_definition = definition;
  }

 private:
  LiveState& st_;
  ThreadRun& run_;
  const bool keep_alive_ = keeping_alive();
};

// NB: not inlined, so each target's launch is one piece of code (the eager one, run by every op,
// then touches fewer instruction cache lines than with the capture's interleaved in its caller).
template <class Target>
C10_NOINLINE void launch_in(Target& target, ThreadRun& run, const std::vector<Access>& accesses,
                            bool async, std::vector<Launched>& launched, uint64_t& period) {
  LiveState& st = target.state();
  const auto& devices = run.devices;
  std::vector<c10::Storage> released;  // dropped after the lock (declared before it)
  std::lock_guard<std::mutex> lock(st.mutex);
  period = st.period;
  target.before_launch(released);
  for (size_t di = 0; di < devices.size(); ++di) {
    const c10::Device device = devices[di];
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
    StreamEntry& se = st.streams.acquire(stream);
    target.enter(se);
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
      // wait and no allocator protection; its use is noted after the launch. (Not for a write that
      // may give it new memory: that needs its entry.)
      StreamId pending_home = 0;
      size_t young_slot = StorageTable::kNoSlot;
      StorageEntry* found = st.storages.lookup(key, &pending_home, &young_slot);
      if constexpr (Target::kHomeUses) {
        if (!cpu_here && !(a.write && a.may_move)) {
          if (found == nullptr && pending_home == 0) {
            // (Note [Storages of unknown origin]: recorded here, it is home here)
            young_slot = target.adopt(se, storage);
            pending_home = se.id;
          }
          if (pending_home == se.id) {
            home_uses.push_back(ThreadRun::HomeUse{key, found, young_slot, a.write});
            continue;
          }
        }
      }
      StorageEntry& e = found != nullptr ? *found : acquire_storage_locked(st, storage);
      define_pending_locked(st, e);
      target.use(e, se, storage, a, cpu_here);
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
      // (an entry stays where it is; a young storage's slot may have gone to another since)
      if (u.entry != nullptr) {
        u.entry->home_uses.note(launch.position.seq, u.write);
      } else {
        st.storages.note_home_use(u.key, launch.position.seq, u.write, u.young_slot);
      }
    }
    for (const auto& ev : wait_events) {
      ev->block(stream);
    }
    wait_events.clear();
    count(&Counters::launches);
    count(&Counters::waits, launch.waits.size());
    target.launched(se, launch, released);
    launched.push_back(Launched{stream, se.id, launch.position.seq});
  }
}

template <class Target>
C10_NOINLINE void finish_in(Target& target, ThreadRun& run, std::vector<Launched>& launched,
                            uint64_t period, const std::vector<at::Tensor>* fresh, bool async,
                            const std::vector<at::Tensor>* moved) {
  LiveState& st = target.state();
  std::lock_guard<std::mutex> lock(st.mutex);
  if (period != 0 && st.period != period) {
    record_instead(run.keep_alive);  // tracking went idle (and maybe live again) since the launch
    return;
  }
  settle_locked(st, launched);
  if (moved != nullptr) {
    target.moved(*moved, launched);
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
          target.enter(se);
          end_run_locked(run, st, se.id);
          const auto launch = st.tracker->launch(se.id, {}, {});
          se.log.note_launched(launch.position.seq);  // (launched already: the op has run)
          target.factory_launched(se, launch.position.seq);
          count(&Counters::launches);
          launched.push_back(Launched{stream, se.id, launch.position.seq});
        }
      }
      target.output(out, Position{launched[g].id, launched[g].seq});
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

}  // namespace

void device_launch(ThreadRun& run, const std::vector<Access>& accesses, bool async,
                   std::vector<Launched>& launched, uint64_t& period,
                   std::optional<c10::Device> target) {
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
  // During a graph capture the op is captured: it launches into the capture's own state.
  if (const TrackedCapturePtr capture = capture_for_launch(devices)) {
    CaptureTarget in_capture(*capture);
    launch_in(in_capture, run, accesses, async, launched, period);
  } else {
    EagerTarget eager(state(), run);
    launch_in(eager, run, accesses, async, launched, period);
  }
}

void settle(const std::vector<Launched>& launched, uint64_t period) {
  TrackedCapturePtr capture;
  if (is_capture_period(period)) {
    capture = capture_of_period(period);
    if (!capture) {
      return;  // (the capture has ended)
    }
  }
  LiveState& st = capture ? capture->st : state();
  std::lock_guard<std::mutex> lock(st.mutex);
  if (st.period == period) {
    settle_locked(st, launched);
  }
}

void finish(ThreadRun& run, std::vector<Launched>& launched, uint64_t period,
            const std::vector<at::Tensor>* fresh, bool async,
            const std::vector<at::Tensor>* moved) {
  // The target the op launched into (period 0, nothing launched yet: a factory, into the target
  // of the devices of its outputs).
  TrackedCapturePtr capture;
  if (is_capture_period(period)) {
    capture = capture_of_period(period);
    if (!capture) {
      record_instead(run.keep_alive);  // the capture it launched in has ended
      return;
    }
  } else if (period == 0 && fresh != nullptr) {
    std::vector<c10::Device> factory_devices;
    for (const at::Tensor& out : *fresh) {
      if (!out.device().is_cpu()) {
        factory_devices.push_back(out.device());
      }
    }
    if (!factory_devices.empty()) {
      capture = capture_for_launch(factory_devices);
    }
  }
  if (capture) {
    CaptureTarget in_capture(*capture);
    finish_in(in_capture, run, launched, period, fresh, async, moved);
  } else {
    EagerTarget eager(state(), run);
    finish_in(eager, run, launched, period, fresh, async, moved);
  }
}

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
