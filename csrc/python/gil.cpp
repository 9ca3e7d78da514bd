#include "gil.h"

#include <pthread.h>
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
std::atomic<int> taking_gil{0};  // threads between their exiting check and holding the GIL
std::atomic<unsigned long> main_ident{0};  // threading.main_thread(), recorded at exit
std::terminate_handler previous_terminate = nullptr;

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Note [threads at exit]: from interpreter finalization on, CPython (before 3.14) ends every
// thread but the finalizing one that tries to take the GIL, with pthread_exit. Its forced unwind
// reaching a noexcept frame (a destructor that takes the GIL back, like
// pybind11::gil_scoped_release's) calls std::terminate: "terminate called without an active
// exception", SIGABRT, for a daemon thread blocked in p.synchronize() when the main thread
// returns. So torch_pipeline never lets a thread other than the main one take the GIL once the
// interpreter is exiting: it parks there instead (its call never returns, as Python 3.14 does with
// such threads), holding none of our locks. set_python_exiting closes the race with a thread that
// passed the check just before: it lets go of the GIL until every such thread has it.
[[noreturn]] void park() {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

bool may_not_take_gil() {
  return exiting.load(std::memory_order_seq_cst) &&
         PyThread_get_thread_ident() != main_ident.load(std::memory_order_relaxed);
}

// The last resort for GIL re-takes outside torch_pipeline's own (a torch op's
// gil_scoped_release on a daemon thread or in a task abandoned at exit): a thread that Python
// ends while the interpreter finalizes reaches std::terminate through a noexcept frame with no
// exception in flight; park it instead of aborting the process, which then exits normally.
[[noreturn]] void terminate_handler() {
  if (exiting.load(std::memory_order_acquire) &&
      (worker_tstate != nullptr ||
       (!std::current_exception() && may_not_take_gil() && python_finalizing()))) {
    park();
  }
  if (previous_terminate != nullptr) {
    previous_terminate();
  }
  std::abort();
}
thread_local bool worker_holds_gil = false;

// Counted while a thread is between its exiting check and holding the GIL (see set_python_exiting).
class TakingGil {
 public:
  TakingGil() { taking_gil.fetch_add(1, std::memory_order_seq_cst); }
  ~TakingGil() { taking_gil.fetch_sub(1, std::memory_order_seq_cst); }
  TakingGil(const TakingGil&) = delete;
  TakingGil& operator=(const TakingGil&) = delete;
};

}  // namespace

void take_gil_back(PyThreadState* state) {
  {
    TakingGil taking;
    if (!may_not_take_gil()) {
      PyEval_RestoreThread(state);
      return;
    }
  }
  park();  // Note [threads at exit]
}

ReleasedGil::ReleasedGil() {
  pybind11::detail::get_internals();  // (as pybind11::gil_scoped_release: initializes its state)
  state_ = PyEval_SaveThread();
}

ReleasedGil::~ReleasedGil() { take_gil_back(state_); }

bool worker_take_gil() {
  if (worker_holds_gil) {
    return true;
  }
  TakingGil taking;
  if (exiting.load(std::memory_order_seq_cst)) {
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

bool python_exiting() { return exiting.load(std::memory_order_acquire); }

void set_python_exiting() {
  // (with the GIL, on the thread running the exit handler)
  unsigned long ident = PyThread_get_thread_ident();
  try {
    const py::object main = py::module_::import("threading").attr("main_thread")();
    ident = main.attr("ident").cast<unsigned long>();
  } catch (const std::exception&) {  // (threading unusable: the caller, the exit handler's thread)
  }
  main_ident.store(ident, std::memory_order_relaxed);
  exiting.store(true, std::memory_order_seq_cst);
  // A thread that passed its check before the store may be waiting for the GIL: let it have it
  // now, before finalization could end it there (Note [threads at exit]). Threads that check
  // later see `exiting`.
  if (taking_gil.load(std::memory_order_seq_cst) > 0) {
    PyThreadState* state = PyEval_SaveThread();
    while (taking_gil.load(std::memory_order_seq_cst) > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    PyEval_RestoreThread(state);
  }
}

void install_terminate_handler() {
  previous_terminate = std::set_terminate(&terminate_handler);
  // A fork child has only the forking thread: none of the parent's is taking the GIL there.
  pthread_atfork(nullptr, nullptr, [] { taking_gil.store(0, std::memory_order_seq_cst); });
}

void wait_releasing_gil(const WaitStep& step, bool interruptible) {
  // (once exiting, a thread other than the main one that holds the GIL lets go of it here and
  // never takes it back: Note [threads at exit])
  const bool holds_gil = Py_IsInitialized() && PyGILState_Check();
  if (!holds_gil) {
    while (!step(kWaitStep)) {
    }
    return;
  }
  for (;;) {
    bool done;
    {
      ReleasedGil no_gil;
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
  const bool may_raise =
      raise_errors_ && type == nullptr && std::uncaught_exceptions() == uncaught_;
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
