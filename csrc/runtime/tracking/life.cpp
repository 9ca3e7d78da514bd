// The live-period module (see life.h): pipeline counts, going live / idle through core::LiveSwitch
// (the transitions run with no lock held), the RecordFunction callback's registration, and the
// fork handler. Touches g_live, g_observing, g_enabled, g_pipelines, g_pins and the callback
// handle; starts and ends periods through the other modules.
#include "life.h"

#include "../../core/live_switch.h"
#include "../capture_probe.h"
#include "graph_capture.h"
#include "host_watch.h"
#include "keep_alive.h"
#include "observer.h"
#include "pins.h"
#include "state.h"
#include "streams.h"

#include <ATen/record_function.h>

#include <pthread.h>

#include <mutex>
#include <optional>

namespace torch_pipeline {
namespace tracking {
namespace detail {

namespace {

// The callback installed by this process (under g_registering): the RecordFunction path's
// observer (by the switching thread), or the dispatcher path's sampled check of other threads (by
// the thread that ends an op once it is wanted: Note [The sampled check is installed on demand]).
std::optional<at::CallbackHandle> g_callback;
bool g_callback_is_check = false;
// A stream of a device type no backend checks joined the period: the check is due.
std::atomic<bool> g_check_wanted{false};
// In a forked child: the parent's callback, still registered (the same functions). Removing it
// in the fork handler could block on a lock a parent's thread held; the child's next go_live
// adopts it instead of adding another (until then it does nothing: g_observing and
// g_dispatch_observing are false).
std::optional<at::CallbackHandle> g_parent_callback;
bool g_parent_callback_is_check = false;
// The dispatcher path's check of Dynamo's ranges, while range_check_due() (removed when tracking
// goes idle; a forked child's copy is left, it only reports).
std::optional<at::CallbackHandle> g_range_check;
std::atomic<uint64_t> g_fork_generation{0};
// Held around adding and removing the callback, and by fork() from its prepare handler to its
// parent/child handlers: a fork never copies torch's callback registry lock held by our switch
// (every op of the child would block on it).
std::mutex g_registering;

// The callback of the observation path chosen (Note [Two ways to observe ops]).
void install_callback(bool dispatcher) {
  std::lock_guard<std::mutex> registering(g_registering);
  if (g_parent_callback.has_value() && g_parent_callback_is_check == dispatcher) {
    g_callback = g_parent_callback;  // (a forked child: the parent's is still registered)
  } else {
    if (g_parent_callback.has_value()) {
      at::removeCallback(*g_parent_callback);
    }
    if (!dispatcher) {
      g_callback = add_observer();  // (the dispatcher path's check waits until it is wanted)
    }
  }
  g_parent_callback.reset();
  g_callback_is_check = dispatcher;
  g_check_wanted.store(false);  // (the new period's streams want it again)
  if (dispatcher && range_check_due() && !g_range_check.has_value()) {
    g_range_check = add_dynamo_range_check();
  }
}

void go_live() {
  (void)keeping_alive();  // reads TORCH_PIPELINE_ALLOCATOR_SAFETY: a bad value raises here
  // The observer first: ops from now on are observed; those queued before the baseline below is
  // recorded (on the streams current now and the default streams) are ordered by it.
  const bool dispatcher = observer() == Observer::kDispatcher && register_dispatch_observer();
  install_callback(dispatcher);
  if (dispatcher) {
    dispatch_observing_started();
  } else {
    g_observing.store(true, std::memory_order_release);
  }
  LiveState& st = state();
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    st.reset();
    // Work launched before (untracked) is ordered before tracked work: each stream waits for
    // this baseline at its first use.
    st.streams.record_baseline();
  }
  g_live.store(true, std::memory_order_release);
}

// Collects under the lock, waits and removes the callback after it. Refuses (false: tracking
// stays live) while a graph capture is underway or about to begin: going idle records events and
// waits on every tracked stream and synchronizes with pending copies, none of which a capture
// allows. It holds a query permit throughout, so a capture's begin waits for it to finish.
bool go_idle() {
  const core::QueryGate::Permit permit = query_gate().permit();  // (no lock is held here)
  if (!permit) {
    return false;  // (wanted() says live while the gate is paused; its end updates again)
  }
  g_live.store(false, std::memory_order_release);
  LiveState& st = state();
  std::vector<std::shared_ptr<c10::Event>> host_pending;
  std::vector<c10::Storage> released;  // dropped after the lock (declared before it)
  uint64_t period = 0;
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    period = st.period;
    st.streams.barrier();
    // CPU memory a non_blocking copy may still be writing: CPU ops will no longer be observed, so
    // wait here (after the lock) for the copies.
    pending_copies_locked(st, host_pending);
    hand_to_allocator_locked(st, released);
  }
  for (const auto& ev : host_pending) {
    try {
      ev->synchronize();
    } catch (const c10::Error& error) {
      explain_failed_query("going idle: a host wait for a non_blocking copy", error, period);
      break;
    }
  }
  {
    std::lock_guard<std::mutex> registering(g_registering);
    if (g_callback.has_value()) {
      at::removeCallback(*g_callback);
      g_callback.reset();
    }
    if (g_range_check.has_value()) {
      at::removeCallback(*g_range_check);
      g_range_check.reset();
    }
    // (under the lock: a check wanted from now on is not installed into the idle process)
    g_observing.store(false, std::memory_order_release);
    g_dispatch_observing.store(false, std::memory_order_release);
  }
  {
    // Again, for what other threads launched while the callback was still installed.
    std::lock_guard<std::mutex> lock(st.mutex);
    st.streams.barrier();
    hand_to_allocator_locked(st, released);
    st.reset();
  }
  released.clear();  // after the lock: may free memory
  return true;
}

core::LiveSwitch& live_switch() {
  static auto* sw = new core::LiveSwitch(core::LiveSwitch::Actions{
      [] {
        // A graph capture underway, or about to begin (the query gate is paused from
        // capture_prepare on), keeps tracking live (going idle would record and wait for events
        // on capturing streams, and go_idle refuses), even when switched off, but does not make
        // it go live.
        return (query_gate().paused() > 0 && g_live.load()) ||
               (g_enabled.load() && (g_pipelines.load() > 0 || g_pins.load() > 0));
      },
      &go_live, &go_idle});
  return *sw;
}

// Around fork(): no switch is adding or removing the callback while the process is copied.
void before_fork() {
  g_registering.lock();  // (a switch in progress finishes adding or removing the callback first)
}

void after_fork_in_parent() { g_registering.unlock(); }

// In the child, right after fork (only the forking thread exists; other threads of the parent
// may have held the tracker's locks): new state and locks, nothing live, no pipelines or pins
// (the parent's pipelines and tasks are left be in a child: see Runtime::current_generation),
// the parent's callback adopted at the next go_live.
void after_fork_in_child() {
  g_registering.unlock();  // (locked by this thread, before the fork)
  g_fork_generation.fetch_add(1);
  g_live.store(false);
  g_observing.store(false);
  g_dispatch_observing.store(false);
  g_pipelines.store(0);
  g_pins.store(0);
  g_host_watch.store(0);
  if (g_callback.has_value()) {
    g_parent_callback = g_callback;
    g_parent_callback_is_check = g_callback_is_check;
    g_callback.reset();
  }
  g_range_check.reset();
  reset_counters_after_fork();
  replace_state_after_fork();
  reset_captures_after_fork();
  reset_pins_after_fork();
  reset_observer_thread_after_fork();
  live_switch().reset_after_fork();
}

struct ForkHandler {
  ForkHandler() { pthread_atfork(&before_fork, &after_fork_in_parent, &after_fork_in_child); }
} fork_handler;

}  // namespace

void compiled_state_changed() {
  if (!range_check_due() || !g_dispatch_observing.load()) {
    return;  // (a check installed stays until tracking goes idle)
  }
  std::lock_guard<std::mutex> registering(g_registering);
  if (!g_range_check.has_value() && g_dispatch_observing.load()) {
    g_range_check = add_dynamo_range_check();
  }
}

void want_sampled_check() { g_check_wanted.store(true, std::memory_order_relaxed); }

void install_wanted_check() {
  if (!g_check_wanted.load(std::memory_order_relaxed)) {
    return;
  }
  std::lock_guard<std::mutex> registering(g_registering);
  if (g_check_wanted.exchange(false) && g_dispatch_observing.load() && !g_callback.has_value()) {
    g_callback = add_sampled_check();
    g_callback_is_check = true;
  }
}

void update_live(bool settle) {
  live_switch().update(settle, [](const core::LiveSwitch::Step& step) { blocking_wait(step); });
}

uint64_t fork_generation() { return g_fork_generation.load(std::memory_order_acquire); }

}  // namespace detail

bool range_check_installed() {
  std::lock_guard<std::mutex> registering(detail::g_registering);
  return detail::g_range_check.has_value();
}

bool sampled_check_installed() {
  std::lock_guard<std::mutex> registering(detail::g_registering);
  return detail::g_callback.has_value() && detail::g_callback_is_check;
}

void pipeline_created() {
  using namespace detail;
  if (g_pipelines.fetch_add(1) == 0 || !live()) {
    try {
      update_live(/*settle=*/true);
    } catch (...) {
      g_pipelines.fetch_sub(1);  // (the pipeline is not made)
      throw;
    }
  }
  observe_this_thread();
}

void pipeline_destroyed() {
  using namespace detail;
  if (g_pipelines.fetch_sub(1) == 1) {
    update_live(/*settle=*/false);
  }
}

bool live() { return detail::g_live.load(std::memory_order_acquire); }

void set_enabled(bool enabled) {
  detail::g_enabled.store(enabled);
  detail::update_live(/*settle=*/true);
  observe_this_thread();
}

bool enabled() { return detail::g_enabled.load(); }

}  // namespace tracking
}  // namespace torch_pipeline
