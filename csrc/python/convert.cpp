#include "convert.h"
#include "threads.h"

#include "../runtime/context.h"
#include "../runtime/devices.h"
#include "../runtime/runtime.h"

#include <torch/csrc/Device.h>

#include <atomic>
#include <climits>

namespace py = pybind11;

namespace torch_pipeline {
namespace python {
namespace {

// Leaked so that no destructor runs after the interpreter is gone.
py::object* g_decorate = nullptr;
py::object* g_work_hooks_installer = nullptr;
std::atomic<bool> g_work_hooks_installed{false};
py::object* g_graph_hooks_installer = nullptr;
std::atomic<bool> g_graph_hooks_installed{false};

}  // namespace

std::string type_name(py::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

bool is_int(py::handle obj) {
  return PyLong_Check(obj.ptr()) && !PyBool_Check(obj.ptr());  // bool is an int to Python
}

std::optional<long long> int_in_range(py::handle obj, long long lo, long long hi) {
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(obj.ptr(), &overflow);
  if (overflow != 0 || v < lo || v > hi) {
    return std::nullopt;
  }
  return v;
}

PipelinePtr to_pipeline(py::handle obj, const char* what) {
  TORCH_CHECK_TYPE(py::isinstance<PipelineImpl>(obj), what,
                   " expects a torch_pipeline.Pipeline, got an object "
                   "of type ",
                   type_name(obj));
  PipelinePtr p = py::cast<PipelinePtr>(obj);
  p->check_usable();
  return p;
}

PipelinePtr to_pipeline_or_current(py::handle obj, const char* what) {
  if (!obj.is_none()) {
    return to_pipeline(obj, what);
  }
  PipelinePtr p = current_pipeline();
  p->check_usable();
  return p;
}

int to_worker_id(py::handle obj) {
  if (obj.is_none()) {
    return 0;
  }
  if (py::isinstance<WorkerThreadHandle>(obj)) {
    return py::cast<WorkerThreadHandle&>(obj).id;
  }
  TORCH_CHECK_TYPE(
      is_int(obj),
      "worker_thread must be a torch_pipeline.WorkerThread, an int or None, got an object of type ",
      type_name(obj));
  const auto id = int_in_range(obj, 0, kMaxWorkerThreadsLimit);
  TORCH_CHECK_VALUE(id.has_value(), "worker thread id ", py::str(obj).cast<std::string>(),
                    " is out of range: the cap is ", max_worker_threads(),
                    " worker threads (ids 0..", max_worker_threads() - 1, ")");
  return static_cast<int>(*id);
}

c10::Device to_device(py::handle obj) {
  TORCH_CHECK_TYPE(THPDevice_Check(obj.ptr()), "expected a torch.device, got an object of type ",
                   type_name(obj));
  return reinterpret_cast<THPDevice*>(obj.ptr())->device;
}

std::optional<c10::Device> to_accelerator_device(py::handle device_like) {
  const auto acc = accelerator();
  if (device_like.is_none()) {
    if (!acc.has_value()) {
      return std::nullopt;
    }
    return current_device(*acc);
  }
  TORCH_CHECK_TYPE(!PyBool_Check(device_like.ptr()),
                   "device must be a torch.device, a str, an int or None, got a bool");
  py::object device = py::reinterpret_borrow<py::object>(device_like);
  if (PyLong_Check(device_like.ptr())) {
    TORCH_CHECK_VALUE(acc.has_value(), "device index ", py::str(device_like).cast<std::string>(),
                      " given, but no accelerator is available");
    check_device_index(*acc, int_in_range(device_like, LLONG_MIN, LLONG_MAX).value_or(LLONG_MAX));
    device = py::module_::import("torch").attr("device")(
        c10::DeviceTypeName(*acc, /*lower_case=*/true), device_like);
  } else if (PyUnicode_Check(device_like.ptr())) {
    check_device_string(py::cast<std::string>(device_like));
    device = py::module_::import("torch").attr("device")(device_like);
  }
  TORCH_CHECK_TYPE(THPDevice_Check(device.ptr()),
                   "device must be a torch.device, a str, an int or None, got ",
                   py::str(py::type::handle_of(device_like).attr("__name__")).cast<std::string>());
  const c10::Device d = to_device(device);
  if (d.is_cpu()) {
    return std::nullopt;
  }
  return d;
}

py::object to_python_stream(const c10::Stream& stream) {
  if (stream.device_type() == c10::kCUDA) {
    return py::module_::import("torch.cuda")
        .attr("Stream")(py::arg("stream_id") = stream.id(),
                        py::arg("device_index") = stream.device_index(),
                        py::arg("device_type") = static_cast<int>(stream.device_type()));
  }
  return py::cast(stream);
}

void set_decorate(py::object fn) {
  TORCH_INTERNAL_ASSERT(g_decorate == nullptr, "decorate callback set twice");
  g_decorate = new py::object(std::move(fn));
}

py::object decorate(py::handle pipeline, py::handle fn) {
  TORCH_INTERNAL_ASSERT(g_decorate != nullptr);
  return (*g_decorate)(pipeline, fn);
}

void set_work_hooks_installer(py::object fn) {
  TORCH_INTERNAL_ASSERT(g_work_hooks_installer == nullptr, "work hooks installer set twice");
  g_work_hooks_installer = new py::object(std::move(fn));
}

void set_graph_hooks_installer(py::object fn) {
  TORCH_INTERNAL_ASSERT(g_graph_hooks_installer == nullptr, "graph hooks installer set twice");
  g_graph_hooks_installer = new py::object(std::move(fn));
}

void note_pipeline_created() {
  observe_python_threads();
  if (g_graph_hooks_installed.load(std::memory_order_acquire) ||
      g_graph_hooks_installer == nullptr) {
    return;
  }
  (*g_graph_hooks_installer)();
  g_graph_hooks_installed.store(true, std::memory_order_release);
}

void note_distributed_use() {
  if (g_work_hooks_installed.load(std::memory_order_acquire) || g_work_hooks_installer == nullptr) {
    return;
  }
  // torch.distributed cannot be initialized before it is imported: skip the call until then.
  PyObject* modules = PyImport_GetModuleDict();
  if (PyDict_GetItemString(modules, "torch.distributed") == nullptr) {
    return;
  }
  if ((*g_work_hooks_installer)().cast<bool>()) {
    g_work_hooks_installed.store(true, std::memory_order_release);
  }
}

}  // namespace python
}  // namespace torch_pipeline
