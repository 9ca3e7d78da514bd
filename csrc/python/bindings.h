// The parts of torch_pipeline._C, one function per area (module.cpp calls them in order).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace torch_pipeline {
namespace python {

// WorkerThread, Pipeline, pipeline(), current/default/set_pipeline, synchronize
// (pipeline_bindings.cpp).
void bind_pipelines(pybind11::module_& m);
// PipelineEvent, task futures, communication streams, tracking, settings (runtime_bindings.cpp).
void bind_runtime(pybind11::module_& m);
// Graph capture hooks, captured graphs and their replays (capture_bindings.cpp).
void bind_capture(pybind11::module_& m);

}  // namespace python
}  // namespace torch_pipeline
