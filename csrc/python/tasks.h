// Python tasks: Pipeline.submit(fn, *args, **kwargs) and the waits on them.
#pragma once

#include "../runtime/pipeline.h"
#include "../runtime/task.h"

#include <torch/csrc/utils/pybind.h>

#include <memory>

namespace torch_pipeline {
namespace python {

// The Python class of the futures submit() returns (torch_pipeline.TaskFuture, a subclass of
// torch.futures.Future); set once at import.
void set_future_class(pybind11::object cls);

// Queues fn(*args, **kwargs) on p's worker thread, to run with p current; returns its future.
pybind11::object submit(
    const PipelinePtr& p, pybind11::object fn, pybind11::tuple args, pybind11::kwargs kwargs);

// Interruptible wait (GIL released) for `sync`, then the caller's current streams wait for the
// task's end. RuntimeError for a task of the parent process after fork().
void wait_task(const TaskSync& sync);

// Interruptible waits for the tasks submitted so far: to `p` / to every worker thread.
// From p's own worker thread, earlier tasks of that thread are already done (FIFO) and later
// ones cannot start before the caller returns, so nothing is waited for there.
void wait_pipeline_tasks(const PipelineImpl& p);
bool pipeline_tasks_done(const PipelineImpl& p);
void wait_all_tasks();

// The interpreter-exit handler: waits (interruptibly, at most `timeout_s` seconds if >= 0) for
// every queued and running task; tasks still queued after that are cancelled with a
// RuntimeError; then workers stop taking the GIL. Returns the number of tasks cancelled.
size_t shutdown(double timeout_s);

}  // namespace python
}  // namespace torch_pipeline
