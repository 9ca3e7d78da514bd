#include "gil.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <thread>
#include <variant>

namespace torch_pipeline {
namespace python {
namespace {

thread_local PyThreadState* worker_tstate = nullptr;  // this worker thread's own thread state
std::atomic<bool> exiting{false};
std::terminate_handler previous_terminate = nullptr;

// A task still running when the interpreter finalizes (abandoned after TORCH_PIPELINE_EXIT_TIMEOUT)
// is ended by Python with pthread_exit as soon as it tries to take the GIL back. When that happens
// inside a noexcept C++ frame (pybind11's gil_scoped_release destructor, which torch ops use), the
// forced unwind calls std::terminate and would abort the whole process. On such a worker thread,
// park the thread instead: it ends with the process, which exits normally.
[[noreturn]] void terminate_handler() {
  if (worker_tstate != nullptr && exiting.load(std::memory_order_acquire)) {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::hours(1));
    }
  }
  if (previous_terminate != nullptr) {
    previous_terminate();
  }
  std::abort();
}
thread_local bool worker_holds_gil = false;

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

void install_terminate_handler() {
  previous_terminate = std::set_terminate(&terminate_handler);
}

void wait_releasing_gil(const WaitStep& step, bool interruptible) {
  const bool holds_gil = !python_exiting() && Py_IsInitialized() && PyGILState_Check();
  if (!holds_gil) {
    while (!step(kWaitStep)) {
    }
    return;
  }
  for (;;) {
    bool done;
    {
      pybind11::gil_scoped_release no_gil;
      done = step(kWaitStep);
    }
    if (done) {
      return;
    }
    if (interruptible && PyErr_CheckSignals() != 0) {
      throw pybind11::error_already_set();
    }
  }
}

PythonWarnings::PythonWarnings(bool raise_errors)
    : previous_(c10::WarningUtils::get_warning_handler()),
      raise_errors_(raise_errors),
      uncaught_(std::uncaught_exceptions()) {
  c10::WarningUtils::set_warning_handler(&buffer_);
}

PythonWarnings::~PythonWarnings() noexcept(false) {
  c10::WarningUtils::set_warning_handler(previous_);
  if (buffer_.warnings.empty() || python_exiting() || !Py_IsInitialized()) {
    return;
  }
  // Keep an error being raised (the caller's) aside while the warnings are issued.
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  bool failed = false;
  for (const c10::Warning& w : buffer_.warnings) {
    PyObject* category = std::holds_alternative<c10::DeprecationWarning>(w.type())
        ? PyExc_DeprecationWarning
        : PyExc_UserWarning;
    if (PyErr_WarnEx(category, w.msg().c_str(), 1) != 0) {
      failed = true;  // -W error: the warning is now a Python exception
      break;
    }
  }
  buffer_.warnings.clear();
  const bool may_raise = raise_errors_ && type == nullptr &&
                         std::uncaught_exceptions() == uncaught_;
  if (failed && may_raise) {
    throw pybind11::error_already_set();
  }
  if (failed) {
    PyErr_WriteUnraisable(nullptr);
  }
  PyErr_Restore(type, value, traceback);
}

}  // namespace python
}  // namespace torch_pipeline
