// Internal to the tracker. The observer room: the RecordFunction callbacks (on_start / on_end)
// and their per-thread state. It finds the outermost op of a thread that touches real storage,
// collects its accesses (arguments, with the write flags of its schema) and fresh outputs, and
// hands them to the pins, host-watch, launch and collectives rooms. Touches only its thread-local
// state and the ops counter itself.
#pragma once

#include <ATen/record_function.h>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// Installs the callbacks (the caller keeps the handle, to remove it).
at::CallbackHandle add_observer();
// In a forked child (on the forking thread): its per-thread state starts over.
void reset_observer_thread_after_fork();

// A compiled region on this thread (CompiledRegion): until end_region(), ops are not observed.
// False (and nothing changes) when the thread is already inside an observed op or region.
bool begin_region();
void end_region();
// Whether torch_pipeline/_compiled.py wrapped AOTAutograd's compiled calls (set_regions_wrapped in
// tracking.h). Without it, a Dynamo "Torch-Compiled Region" in which nothing was tracked is
// counted and warned about once.
bool regions_wrapped();

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
