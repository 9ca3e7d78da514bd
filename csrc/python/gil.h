// The GIL as worker threads and waiting callers use it.
//
// Worker threads keep one Python thread state for their whole life (so threading.local works in
// tasks) and keep the GIL across a batch of consecutive Python tasks, letting go of it when their
// queue is empty (the WorkerThread idle hook). Once the interpreter is exiting, no worker takes the
// GIL again.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <chrono>

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

// Installs (once, at import) a terminate handler that parks abandoned worker threads that Python
// ends during finalization instead of aborting the process (see gil.cpp).
void install_terminate_handler();

// Calls `step(timeout)` with the GIL released until it returns true; between steps (every
// kPollInterval) checks for signals with the GIL held, so Ctrl-C raises KeyboardInterrupt in the
// waiting thread. The caller holds the GIL.
constexpr std::chrono::milliseconds kPollInterval{50};

template <typename Step>
void wait_interruptibly(Step&& step) {
  for (;;) {
    bool done;
    {
      pybind11::gil_scoped_release no_gil;
      done = step(kPollInterval);
    }
    if (done) {
      return;
    }
    if (PyErr_CheckSignals() != 0) {
      throw pybind11::error_already_set();
    }
  }
}

}  // namespace python
}  // namespace torch_pipeline
