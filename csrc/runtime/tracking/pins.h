// Internal to the tracker. The task-pins module: tensors passed to submit are pinned by the task
// (TaskPins); a write to them from another thread waits until the task releases them. Also the
// blocking wait the tracker uses (installed by the Python layer, which lets go of the GIL). Touches
// StorageData::pins, g_pins and the blocking-wait hook.
#pragma once

#include "state.h"

#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// Blocks until step(timeout) returns true, through the installed BlockingWait (plain polling if
// none).
void blocking_wait(const Step& step);
// Writes among `accesses` to storages a task pins wait until the task is done (not on the task's
// own worker thread). Takes LiveState::mutex; waits after releasing it.
void wait_for_pins(const std::vector<Access>& accesses);
// In a forked child: the hook's lock is replaced.
void reset_pins_after_fork();

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
