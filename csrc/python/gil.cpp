#include "gil.h"

#include <atomic>

namespace torch_pipeline {
namespace python {
namespace {

thread_local PyThreadState* worker_tstate = nullptr;  // this worker thread's own thread state
thread_local bool worker_holds_gil = false;
std::atomic<bool> exiting{false};

}  // namespace

bool worker_take_gil() {
  if (worker_holds_gil) {
    return true;
  }
  if (exiting.load(std::memory_order_acquire)) {
    return false;
  }
  if (worker_tstate == nullptr) {
    // Creates the thread state and takes the GIL. The matching PyGILState_Release never comes:
    // the thread state lives as long as the thread.
    PyGILState_Ensure();
    worker_tstate = PyThreadState_Get();
  } else {
    PyEval_RestoreThread(worker_tstate);
  }
  worker_holds_gil = true;
  return true;
}

void worker_release_gil() {
  if (worker_holds_gil) {
    worker_holds_gil = false;
    PyEval_SaveThread();
  }
}

bool python_exiting() {
  return exiting.load(std::memory_order_acquire);
}

void set_python_exiting() {
  exiting.store(true, std::memory_order_release);
}

}  // namespace python
}  // namespace torch_pipeline
