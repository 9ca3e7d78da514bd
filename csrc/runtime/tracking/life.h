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

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
