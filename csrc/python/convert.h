// Argument checking and conversion for the bindings (Python objects <-> runtime values), and the
// few callbacks into the Python package that the bindings make.
#pragma once

#include "../runtime/pipeline.h"

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>

namespace torch_pipeline {
namespace python {

// A worker-thread handle: only get_worker_thread(i) makes them (the id is checked there).
struct WorkerThreadHandle {
  int id;
};

std::string type_name(pybind11::handle obj);
// A Python int that is not a bool.
bool is_int(pybind11::handle obj);
// The value of a Python int if it is in [lo, hi], else nullopt (also when it overflows).
std::optional<long long> int_in_range(pybind11::handle obj, long long lo, long long hi);

// TypeError unless `obj` is a Pipeline, RuntimeError (naming fork) for a pipeline of the parent
// process; `what` names the caller in the message.
PipelinePtr to_pipeline(pybind11::handle obj, const char* what);
// None: the calling thread's current pipeline.
PipelinePtr to_pipeline_or_current(pybind11::handle obj, const char* what);
// A WorkerThread, an int id or None (worker thread 0); TypeError / ValueError otherwise.
int to_worker_id(pybind11::handle obj);
// A torch.device (TypeError otherwise).
c10::Device to_device(pybind11::handle obj);
// The accelerator device meant by a device-like (torch.device, str, int index on the current
// accelerator, None for the current accelerator device); nullopt for the CPU or when there is no
// accelerator. TypeError / ValueError for anything else.
std::optional<c10::Device> to_accelerator_device(pybind11::handle device_like);
// A stream as Python sees it: torch.cuda.Stream on CUDA, torch.Stream elsewhere.
pybind11::object to_python_stream(const c10::Stream& stream);

// Callbacks into the torch_pipeline package, set once at its import.
// torch_pipeline._decorators._decorate(pipeline_or_None, fn): what `@p` returns.
void set_decorate(pybind11::object fn);
pybind11::object decorate(pybind11::handle pipeline, pybind11::handle fn);
// torch_pipeline._collectives._install_work_hooks_if_distributed(): installs the c10d Work hooks
// and returns True once torch.distributed is initialized. note_distributed_use() calls it (on
// Pipeline creation and submit) until it has returned True.
void set_work_hooks_installer(pybind11::object fn);
void note_distributed_use();
// torch_pipeline._graphs.install_cuda_graph_hooks(): wraps torch.cuda.CUDAGraph's capture and
// replay methods. note_pipeline_created() calls it once, at the first Pipeline made.
void set_graph_hooks_installer(pybind11::object fn);
void note_pipeline_created();

}  // namespace python
}  // namespace torch_pipeline
