// The GIL as worker threads and waiting callers use it.
//
// Worker threads keep one Python thread state for their whole life (so threading.local works in
// tasks) and keep the GIL across a batch of consecutive Python tasks, letting go of it when their
// queue is empty (the WorkerThread idle hook). Once the interpreter is exiting, no worker takes the
// GIL again.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include "../runtime/host_waits.h"

#include <c10/util/Exception.h>

#include <vector>

namespace torch_pipeline {
namespace python {

// On a worker thread: takes the GIL unless this thread already holds it. Returns false, without
// the GIL, once the interpreter is exiting.
bool worker_take_gil();
// The worker idle hook: lets go of the GIL if this worker thread holds it.
void worker_release_gil();

// Set by the interpreter-exit handler once the last tasks have finished or been given up.
bool python_exiting();
void set_python_exiting();

// Installs (once, at import) a terminate handler that parks threads that Python ends during
// finalization inside a noexcept frame instead of aborting the process (see gil.cpp), and the
// fork handler of the GIL state.
void install_terminate_handler();

// Takes the GIL back after PyEval_SaveThread() gave `state`; once the interpreter is exiting, a
// thread other than the main one never returns (it parks: Note [threads at exit] in gil.cpp).
void take_gil_back(PyThreadState* state);

// RAII, on a thread that holds the GIL: pybind11::gil_scoped_release (which our bindings use
// this instead of, also as py::call_guard) that takes the GIL back with take_gil_back.
class ReleasedGil {
 public:
  ReleasedGil();
  ~ReleasedGil();
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;

 private:
  PyThreadState* state_;
};

// The one blocking wait of torch_pipeline (installed as the runtime's block hook, see
// csrc/runtime/host_waits.h, and as the tracker's blocking wait): runs `step(kWaitStep)` until it
// returns true. A thread that holds the GIL lets go of it while a step runs (the thread being
// waited for may need it) and, if `interruptible`, checks for signals between steps, so Ctrl-C
// raises KeyboardInterrupt (pybind11::error_already_set) in the waiting thread. Once the
// interpreter is exiting, Python is not touched.
void wait_releasing_gil(const WaitStep& step, bool interruptible);

// RAII, on a thread that holds the GIL: c10 warnings (TORCH_WARN, torch_pipeline::warn) raised
// in its scope become Python warnings when it ends, so `warnings.catch_warnings` and
// `pytest.warns` see them. Used where no torch binding does it: around our bindings' calls and
// around a task's completion on a worker thread. A warning that Python turns into an error
// (`-W error`) is raised if `raise_errors` and no exception is in flight, else reported as
// unraisable.
class PythonWarnings {
 public:
  explicit PythonWarnings(bool raise_errors = true);
  ~PythonWarnings() noexcept(false);
  PythonWarnings(const PythonWarnings&) = delete;
  PythonWarnings& operator=(const PythonWarnings&) = delete;

 private:
  struct Buffer : c10::WarningHandler {
    void process(const c10::Warning& warning) override { warnings.push_back(warning); }
    std::vector<c10::Warning> warnings;
  };
  Buffer buffer_;
  c10::WarningHandler* previous_;
  const bool raise_errors_;
  const int uncaught_;
};

}  // namespace python
}  // namespace torch_pipeline
