#include "tasks.h"
#include "threads.h"

#include "gil.h"

#include "../runtime/context.h"
#include "../runtime/host_waits.h"
#include "../runtime/runtime.h"
#include "../runtime/task.h"
#include "../runtime/tracking.h"
#include "../runtime/warn.h"

#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <iostream>
#include <optional>
#include <string>
#include <unordered_set>

namespace py = pybind11;

namespace torch_pipeline {
namespace python {
namespace {

PyObject* g_future_class = nullptr;   // strong reference, never released
std::atomic<bool> g_draining{false};  // the exit handler runs: only tasks may submit

// "task step() of pipeline id=1 (priority 0)": what a task is, in messages.
std::string describe_task(const PipelineImpl& p, py::handle fn) {
  std::string name = Py_TYPE(fn.ptr())->tp_name;
  if (PyObject* qualname = PyObject_GetAttrString(fn.ptr(), "__qualname__")) {
    const char* utf8 = PyUnicode_Check(qualname) ? PyUnicode_AsUTF8(qualname) : nullptr;
    if (utf8 != nullptr) {
      name = utf8;
    } else {
      PyErr_Clear();
    }
    Py_DECREF(qualname);
  } else {
    PyErr_Clear();
  }
  std::string what = "task " + name + "() of ";
  if (p.is_default()) {
    return what + "the default pipeline";
  }
  return what + "pipeline id=" + std::to_string(p.id()) + " (priority " +
         std::to_string(p.priority()) + ")";
}

// A profiler running on the submitting thread (torch.profiler records the threads it was started
// on): its RecordFunction callbacks and state, carried to the task so its ops and its range are
// recorded too, as at::launch carries them.
struct Profiling {
  at::RecordFunctionTLS callbacks;
  std::shared_ptr<c10::ThreadLocalDebugInfo> debug_info;
};

std::optional<Profiling> submitter_profiling() {
  if (!at::hasThreadLocalCallbacks()) {
    return std::nullopt;
  }
  return Profiling{at::get_record_function_tls_(), c10::ThreadLocalDebugInfo::current()};
}

// RAII: the submitter's profiling on this thread, then what was there before.
class ProfilingGuard {
 public:
  explicit ProfilingGuard(const std::optional<Profiling>& p) {
    if (p.has_value()) {
      saved_ = at::get_record_function_tls_();
      at::set_record_function_tls_(p->callbacks);
      debug_.emplace(p->debug_info);
    }
  }
  ~ProfilingGuard() {
    debug_.reset();
    if (saved_.has_value()) {
      at::set_record_function_tls_(*saved_);
    }
  }
  ProfilingGuard(const ProfilingGuard&) = delete;
  ProfilingGuard& operator=(const ProfilingGuard&) = delete;

 private:
  std::optional<at::RecordFunctionTLS> saved_;
  std::optional<c10::DebugInfoGuard> debug_;
};

// The Python references of a task are raw so that no destructor ever touches Python without the
// GIL: they are dropped with the GIL held, or leaked once the interpreter is exiting.
class PyTask final : public core::Task {
 public:
  PyTask(core::WorkerThread* worker, PipelinePtr pipeline, py::object fn, py::tuple args,
         py::dict kwargs, py::object future, std::shared_ptr<TaskSync> sync,
         std::unique_ptr<tracking::TaskPins> pins, std::optional<Profiling> profiling)
      : description_(describe_task(*pipeline, fn)),
        profiling_(std::move(profiling)),
        worker_(worker),
        pipeline_(std::move(pipeline)),
        fn_(fn.release().ptr()),
        args_(args.release().ptr()),
        kwargs_(kwargs.release().ptr()),
        future_(future.release().ptr()),
        sync_(std::move(sync)),
        pins_(std::move(pins)) {}

  ~PyTask() override {
    if (fn_ == nullptr) {
      return;
    }
    if (python_exiting() || !Py_IsInitialized()) {
      return;  // leak: the interpreter is going away
    }
    py::gil_scoped_acquire gil;
    drop_references();
  }

  void run() override {
    if (!worker_take_gil()) {
      abandon();
      return;
    }
    {
      PythonWarnings warnings(/*raise_errors=*/false);  // nobody to raise them to here
      try {
        run_in_pipeline();
      } catch (const std::exception& e) {
        // Entering the pipeline failed (a stream could not be made current, say).
        complete("set_exception", make_runtime_error(e.what()));
      }
      drop_references();
    }
    pins_->release();  // the task no longer needs its tensors
    if (worker_->pending() == 0) {
      // Nothing else to run: let go of the GIL before waking the waiter, which needs it.
      worker_release_gil();
    }
    sync_->mark_done();
    pipeline_.reset();  // may be the last reference: the slot is released
  }

  std::string describe() const override { return description_; }

  void cancel(const std::string& reason) noexcept override {
    if (python_exiting()) {
      abandon();
      return;
    }
    {
      py::gil_scoped_acquire gil;
      try {
        complete("set_exception", make_runtime_error(reason));
      } catch (const std::exception&) {
      }
      drop_references();
    }
    pins_->release();
    sync_->mark_done();
  }

 private:
  // With the GIL held: fn(*args, **kwargs) with the pipeline current, after its streams waited
  // for the submitter; the end of its device work is recorded before the future completes.
  void run_in_pipeline() {
    ProfilingGuard profiling(profiling_);
    tracking::TaskPins::Running running(*pins_);  // (its writes, and its tasks', skip its pins)
    PipelineGuard guard(pipeline_);
    sync_->wait_for_submitter(*pipeline_);
    PyObject* result = nullptr;
    {
      // A named range for profilers, around the task's body.
      std::optional<at::RecordFunction> range;
      if (at::hasCallbacks()) {
        range.emplace(at::RecordScope::USER_SCOPE);
        if (range->isActive()) {
          range->before("tp." + description_);  // "tp.task fn() of pipeline id=..."
        }
      }
      result = PyObject_Call(fn_, args_, kwargs_);
    }
    py::object outcome;
    bool ok = result != nullptr;
    if (ok) {
      outcome = py::reinterpret_steal<py::object>(result);
    } else {
      py::error_already_set err;  // takes the Python error raised by fn
      outcome = err.value();
      if (PyObject_IsInstance(outcome.ptr(), PyExc_Exception) != 1) {
        // torch futures hold Exceptions only (KeyboardInterrupt, SystemExit are not)
        outcome = make_runtime_error(std::string("task raised ") + err.what());
      }
    }
    try {
      sync_->record_end(*pipeline_);
    } catch (const std::exception& e) {
      ok = false;
      outcome = make_runtime_error(
          std::string("torch_pipeline: could not record the end of the task's work: ") + e.what());
    }
    complete(ok ? "set_result" : "set_exception", outcome);
  }

  static py::object make_runtime_error(const std::string& message) {
    return py::reinterpret_steal<py::object>(
        PyObject_CallFunction(PyExc_RuntimeError, "s", message.c_str()));
  }

  // future.set_result(value) / set_exception(value). A failure there cannot be raised to anyone:
  // it becomes the task's exception, or, if that cannot be set either, a warning.
  void complete(const char* method, const py::object& value) {
    py::handle future(future_);
    try {
      future.attr(method)(value);
    } catch (py::error_already_set& e) {
      try {
        future.attr("set_exception")(e.value());
      } catch (py::error_already_set& e2) {
        warn(std::string("could not complete a task's future: ") + e2.what());
      }
    }
  }

  void drop_references() {
    Py_CLEAR(fn_);
    Py_CLEAR(args_);
    Py_CLEAR(kwargs_);
    Py_CLEAR(future_);
  }

  // The interpreter is exiting: Python must not be touched. Leak the references.
  void abandon() noexcept {
    fn_ = args_ = kwargs_ = future_ = nullptr;
    pins_->release();
    sync_->mark_done();
  }

  const std::string description_;  // for error messages (core::Task::describe)
  const std::optional<Profiling> profiling_;
  core::WorkerThread* const worker_;  // the worker this task is queued on
  PipelinePtr pipeline_;
  PyObject* fn_;
  PyObject* args_;
  PyObject* kwargs_;
  PyObject* future_;
  std::shared_ptr<TaskSync> sync_;
  std::unique_ptr<tracking::TaskPins> pins_;
};

}  // namespace

void set_future_class(py::object cls) {
  TORCH_INTERNAL_ASSERT(g_future_class == nullptr, "future class set twice");
  g_future_class = cls.release().ptr();
}

py::object submit(const PipelinePtr& p, py::object fn, py::tuple args, py::kwargs kwargs) {
  TORCH_CHECK_TYPE(PyCallable_Check(fn.ptr()),
                   "submit() expects a callable as its first argument, got an "
                   "object of type ",
                   Py_TYPE(fn.ptr())->tp_name);
  TORCH_CHECK(
      !python_exiting() &&
          (!g_draining.load(std::memory_order_acquire) || core::WorkerThread::current_id() >= 0),
      "torch_pipeline is shutting down (the interpreter is exiting): no new tasks are accepted");
  p->check_usable();
  TORCH_INTERNAL_ASSERT(g_future_class != nullptr);
  core::WorkerThread& worker = Runtime::get().worker(p->worker_id());

  // No devices=...: a device-aware torch future pickles every result to find its tensors (so a
  // generator, a lambda or a Pipeline could not be returned). TaskFuture.wait() orders the
  // waiter's streams after the task's through `sync` instead.
  py::object future = py::reinterpret_borrow<py::object>(g_future_class)();
  auto sync = std::make_shared<TaskSync>(p->worker_id());
  sync->record_submitter_position();
  future.attr("_tp_sync") = py::cast(sync);

  // The task sees its tensors as they are now: later writes from other threads wait for it.
  std::vector<at::Tensor> tensors = collect_tensors(args);
  for (at::Tensor& t : collect_tensors(kwargs)) {
    tensors.push_back(std::move(t));
  }
  auto pins = std::make_unique<tracking::TaskPins>(tensors, p->worker_id());
  observe_python_threads();  // (the pins may have made tracking go live)

  auto task =
      std::make_unique<PyTask>(&worker, p, std::move(fn), std::move(args), std::move(kwargs),
                               future, sync, std::move(pins), submitter_profiling());
  const uint64_t seq = worker.submit(std::move(task));
  sync->set_seq(seq);
  p->note_task(seq);
  return future;
}

namespace {
// An instance of a @dataclass (a batch, a model output): its fields are walked like a container's.
bool is_dataclass_instance(PyObject* ptr) {
  return !PyType_Check(ptr) &&
         PyObject_HasAttrString(reinterpret_cast<PyObject*>(Py_TYPE(ptr)), "__dataclass_fields__");
}
}  // namespace

std::vector<at::Tensor> collect_tensors(py::handle obj) {
  std::vector<at::Tensor> out;
  std::unordered_set<PyObject*> seen;  // containers and tensors already walked
  std::vector<py::object> todo{py::reinterpret_borrow<py::object>(obj)};
  while (!todo.empty()) {
    py::object o = std::move(todo.back());
    todo.pop_back();
    PyObject* ptr = o.ptr();
    const bool tensor = THPVariable_Check(ptr);
    const bool builtin = !tensor && (PyList_Check(ptr) || PyTuple_Check(ptr) || PyDict_Check(ptr) ||
                                     PyAnySet_Check(ptr));
    // The attribute lookup not for every int, str and plain container of a state_dict; but for
    // subclasses (HF's ModelOutput is an OrderedDict dataclass, walked by its fields).
    const bool exact =
        PyList_CheckExact(ptr) || PyTuple_CheckExact(ptr) || PyDict_CheckExact(ptr) ||
        PyAnySet_CheckExact(ptr) || PyLong_CheckExact(ptr) || PyFloat_CheckExact(ptr) ||
        PyUnicode_CheckExact(ptr) || PyBytes_CheckExact(ptr) || ptr == Py_None || PyBool_Check(ptr);
    const bool dataclass = !tensor && !exact && is_dataclass_instance(ptr);
    const bool container = builtin || dataclass;
    if ((!tensor && !container) || !seen.insert(ptr).second) {
      continue;
    }
    if (tensor) {
      out.push_back(THPVariable_Unpack(ptr));
      // A wrapper subclass (DTensor, ...) holds its data in inner tensors.
      if (!THPVariable_CheckExact(ptr) && py::hasattr(o, "__tensor_flatten__")) {
        py::tuple flat = o.attr("__tensor_flatten__")();
        for (py::handle name : flat[0]) {
          todo.push_back(o.attr(name));
        }
      }
    } else if (dataclass) {
      // Its fields (ClassVar and InitVar pseudo-fields are listed too: a missing one is skipped).
      py::object fields =
          py::handle(reinterpret_cast<PyObject*>(Py_TYPE(ptr))).attr("__dataclass_fields__");
      for (py::handle name : fields) {
        todo.push_back(py::getattr(o, name, py::none()));
      }
    } else if (PyDict_Check(ptr)) {
      PyObject *key, *value;
      Py_ssize_t pos = 0;
      while (PyDict_Next(ptr, &pos, &key, &value)) {
        todo.push_back(py::reinterpret_borrow<py::object>(key));
        todo.push_back(py::reinterpret_borrow<py::object>(value));
      }
    } else {
      for (py::handle item : o) {
        todo.push_back(py::reinterpret_borrow<py::object>(item));
      }
    }
  }
  return out;
}

size_t shutdown(double timeout_s) {
  if (python_exiting()) {
    return 0;
  }
  g_draining.store(true, std::memory_order_release);
  const DrainResult r = drain_tasks(timeout_s);
  if (!r.finished) {
    // At interpreter exit: stderr, not a warning (the warnings machinery may be gone).
    std::cerr << "torch_pipeline: at interpreter exit, " << r.why << ": cancelled " << r.cancelled
              << " queued task(s); " << r.running << " running task(s) abandoned" << std::endl;
  }
  set_python_exiting();
  return r.cancelled;
}

}  // namespace python
}  // namespace torch_pipeline
