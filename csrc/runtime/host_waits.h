// Host waits of the runtime, the ones that block the calling thread (a stream wait, which orders
// a stream after an event, is an Event::block elsewhere): for tasks, pipelines and devices
// (docs/design.md, "The Python API and the rules users rely on": Pipeline.query/synchronize,
// torch_pipeline.synchronize, TaskFuture.wait, the exit drain).
//
// Every wait goes through block_until(), which runs a wait step until it reports done. The Python
// layer installs the blocking hook (csrc/python/gil.h): it lets go of the GIL while a step runs
// (the task being waited for may need it) and raises KeyboardInterrupt on Ctrl-C between steps.
#pragma once

#include "pipeline.h"
#include "task.h"

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

namespace torch_pipeline {

// One wait step: blocks for at most `timeout`; returns true when the awaited thing is done.
using WaitStep = std::function<bool(std::chrono::milliseconds)>;
// Runs `step` until it returns true; `interruptible`: may throw between steps (Ctrl-C).
using BlockHook = std::function<void(const WaitStep& step, bool interruptible)>;
constexpr std::chrono::milliseconds kWaitStep{50};

// Installs the hook (once, at import). Without one, steps run in a plain loop.
void set_block_hook(BlockHook hook);
// Blocks the calling thread until step returns true (see set_block_hook).
void block_until(const WaitStep& step, bool interruptible = true);

// Waits for `sync`'s task, then the calling thread's current streams wait for the task's end.
// RuntimeError for a task of the parent process after fork(), or for a task of the calling
// worker thread that has not run yet (it would wait forever).
void wait_task(const TaskSync& sync);

// The tasks submitted to `p` so far are done / wait for them. From p's own worker thread, earlier
// tasks are already done (FIFO) and later ones cannot start before the caller returns, so nothing
// is waited for there.
bool pipeline_tasks_done(const PipelineImpl& p);
void wait_pipeline_tasks(const PipelineImpl& p);

// Pipeline.query(): its tasks are done and its streams have no pending work.
bool query_pipeline(PipelineImpl& p);
// Pipeline.synchronize(): waits for its tasks, then for its streams.
void synchronize_pipeline(PipelineImpl& p);
// Pipeline.wait_pipeline(other): `waiter`'s streams wait for `other`'s current position.
void wait_pipeline(PipelineImpl& waiter, PipelineImpl& other);
// The streams `p` has now (acquiring none). RuntimeError for a pipeline of the parent process.
DeviceStreams existing_streams(PipelineImpl& p);

// torch_pipeline.synchronize(): every task of every worker thread, then every initialized
// accelerator device. RuntimeError from a task (it would wait for itself).
void synchronize_all();

// The interpreter-exit drain: waits (at most `timeout_s` seconds if >= 0) for every queued and
// running task, also those queued while it waits; if they do not all finish (timeout, or an
// interrupted wait), cancels the queued ones with a RuntimeError.
struct DrainResult {
  bool finished = true;
  size_t cancelled = 0;  // queued tasks cancelled
  size_t running = 0;    // worker threads still running a task (abandoned)
  std::string why;       // why not finished
};
DrainResult drain_tasks(double timeout_s);

}  // namespace torch_pipeline
