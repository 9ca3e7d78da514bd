// Python tasks: Pipeline.submit(fn, *args, **kwargs) and the interpreter-exit drain. The waits on
// tasks are the runtime's (csrc/runtime/host_waits.h).
#pragma once

#include "../runtime/pipeline.h"

#include <torch/csrc/utils/pybind.h>

#include <cstddef>
#include <vector>

namespace torch_pipeline {
namespace python {

// The Python class of the futures submit() returns (torch_pipeline.TaskFuture, a subclass of
// torch.futures.Future); set once at import.
void set_future_class(pybind11::object cls);

// Queues fn(*args, **kwargs) on p's worker thread, to run with p current; returns its future.
// The future is a plain (device-less) torch future, so the result may be any Python object; the
// ordering of wait() comes from the task's TaskSync (TaskFuture.wait).
pybind11::object submit(const PipelinePtr& p, pybind11::object fn, pybind11::tuple args,
                        pybind11::kwargs kwargs);

// The tensors a task is given: `obj` itself, or inside lists, tuples (namedtuples), dicts (keys
// and values) and sets, at any depth (iterative, each container once, so cycles end); tensor
// subclasses count, and wrapper subclasses also give their inner tensors (__tensor_flatten__).
std::vector<at::Tensor> collect_tensors(pybind11::handle obj);

// The interpreter-exit handler: waits (interruptibly, at most `timeout_s` seconds if >= 0) for
// every queued and running task; tasks still queued after that are cancelled with a
// RuntimeError (a line on stderr says so); then workers stop taking the GIL. Returns the number
// of tasks cancelled.
size_t shutdown(double timeout_s);

}  // namespace python
}  // namespace torch_pipeline
