// Internal to the tracker. The live-period module: when tracking is live (a non-default pipeline or
// a task's pins alive, and enabled), going live / idle through core::LiveSwitch (no lock held
// across device waits or callback removal), and the fork handler that resets the tracker in a
// child. Touches g_live, g_observing, g_pipelines, g_pins, the callback registration, and calls
// the other modules to start and end a period.
#pragma once

#include <cstdint>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// Brings live() in line with what is wanted. settle: return only once it is (waiting, through the
// blocking wait, for another thread that is switching); otherwise that thread sees the request.
void update_live(bool settle);
// Forks so far seen by this process's tracker (0 in the original process, then one per fork in a
// child): a pin taken in a parent does not count in a child.
uint64_t fork_generation();

// Note [The sampled check is installed on demand]: the dispatcher path's sampled RecordFunction
// check of threads without the key is a global callback, and any global callback costs every
// thread: each op counts down its sampling, and each restore of a thread-local state (the autograd
// engine's, once per node) copies the callbacks and rebuilds the thread's cache of them (about
// 1,100 instructions and two allocations per node). A device type whose backend checks every
// device op itself (set_backend_checks: the sim device) needs none of it, so the check is
// installed only once the period has a stream of a device type no backend checks (CUDA, for
// one): the stream table calls want_sampled_check() when it makes such an entry (under the
// state's lock), and the op's end installs it (install_wanted_check(), after every lock), until
// the period ends.
void want_sampled_check();
void install_wanted_check();

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
