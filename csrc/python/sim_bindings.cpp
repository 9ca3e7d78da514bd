#include "sim_bindings.h"
#include "gil.h"

#include "../runtime/op_facts.h"
#include "../sim/aliases.h"
#include "../sim/executor.h"
#include "../sim/graph_capture.h"
#include "../sim/latency.h"
#include "../sim/names.h"
#include "../sim/sim.h"
#include "../sim/state.h"
#include "../sim/trace.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_anomaly_mode.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace torch_pipeline {
namespace python {
namespace {

// torch_pipeline.sim.RaceError (a RuntimeError subclass), made once and leaked.
PyObject* g_race_error = nullptr;

// A race in strict mode is thrown from inside aten ops, which torch's own bindings turn into
// Python exceptions: a torch::PyTorchError names the Python type it becomes.
struct RaceErrorPy : public torch::PyTorchError {
  using torch::PyTorchError::PyTorchError;
  PyObject* python_type() override { return g_race_error; }
};

void throw_race_error(const std::string& message) { throw RaceErrorPy(message); }

// torch_pipeline.sim.DeviceIndexError (a ValueError and a RuntimeError), made once and leaked.
PyObject* g_device_index_error = nullptr;

struct DeviceIndexErrorPy : public torch::PyTorchError {
  using torch::PyTorchError::PyTorchError;
  PyObject* python_type() override { return g_device_index_error; }
};

void throw_device_index_error(const std::string& message) { throw DeviceIndexErrorPy(message); }

// The per-operator facts (csrc/runtime/op_facts.h) of "aten::add_.Tensor" as the sim's kernels
// look them up (by operator handle), as a dict; `id` identifies the facts object.
py::dict op_facts_dict(const std::string& full_name) {
  const auto view = c10::OperatorNameView::parse(full_name);
  const c10::OperatorName name{std::string(view.name), std::string(view.overload_name)};
  const auto op = c10::Dispatcher::singleton().findSchema(name);
  TORCH_CHECK_VALUE(op.has_value(), "'", full_name,
                    "' is not a registered operator: expected a name such as "
                    "'aten::add_.Tensor' (the default overload has no suffix: 'aten::nonzero')");
  const OpFacts& f = op_facts(*op);
  TORCH_INTERNAL_ASSERT(&f == &op_facts(name), "two facts objects for ", full_name);
  const auto& args = op->schema().arguments();
  py::list written;
  for (size_t i = 0; i < args.size(); ++i) {
    if (f.write[i] != 0) {
      written.append(args[i].name());
    }
  }
  py::dict d;
  d["name"] = f.name;
  d["overload"] = f.overload;
  d["full_name"] = f.full_name;
  d["written"] = written;
  // (the bool argument that turns on the writes of Note [Writes a schema hides], or None)
  d["written_if"] =
      f.written_if >= 0 ? py::object(py::str(args[f.written_if].name())) : py::object(py::none());
  d["transparent"] = f.transparent;
  d["non_blocking"] = f.non_blocking >= 0 ? py::object(py::str(args[f.non_blocking].name()))
                                          : py::object(py::none());
  d["syncs_host"] = f.syncs_host;
  d["known"] = f.known;
  d["id"] = reinterpret_cast<uintptr_t>(&f);
  return d;
}

// Calls fn() and returns (full name, facts id) of each op it ran, as the tracker looks them up
// (from its RecordFunction), to compare with op_facts_dict's.
std::vector<std::pair<std::string, uintptr_t>> op_facts_observed(const py::function& fn) {
  thread_local std::vector<std::pair<std::string, uintptr_t>>* sink = nullptr;
  std::vector<std::pair<std::string, uintptr_t>> seen;
  auto observe = [](const at::RecordFunction& rf) -> std::unique_ptr<at::ObserverContext> {
    const OpFacts& f = op_facts(rf);
    if (f.known && sink != nullptr) {
      sink->emplace_back(f.full_name, reinterpret_cast<uintptr_t>(&f));
    }
    return nullptr;
  };
  const at::CallbackHandle handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(observe).scopes({at::RecordScope::FUNCTION}));
  struct Scope {  // restores the sink and removes the callback, also when fn() raises
    std::vector<std::pair<std::string, uintptr_t>>* previous;
    at::CallbackHandle handle;
    ~Scope() {
      at::removeCallback(handle);
      sink = previous;
    }
  } scope{sink, handle};
  sink = &seen;
  fn();
  return seen;
}

// Note [Race reports with sites]: a site is the Python stack of the thread that called the op,
// captured as torch's memory snapshots capture theirs (code objects and positions, symbolized
// only when a report asks). An op of a backward pass runs on an autograd engine thread, which has
// no Python frames: its site is the node it computes (e.g. "MmBackward0") and, when the forward
// ran in anomaly mode, the stack that made the node (autograd keeps it as text).
struct PythonSite final : sim::AccessSite {
  std::shared_ptr<torch::CapturedTraceback> traceback;
  std::string backward_of;                 // the autograd node, for an op of a backward pass
  std::vector<std::string> forward_stack;  // anomaly mode: traceback.format_stack() of its forward
};

// The anomaly-mode forward stack of `node` (empty without it). Needs the GIL.
template <class NodePtr>
std::vector<std::string> forward_stack_of(const NodePtr& node) {
  std::vector<std::string> out;
  // NB: a static_cast (PyAnomalyMetadata's type info is not exported): in a Python process the
  // autograd engine is the PythonEngine, whose nodes' metadata is always a PyAnomalyMetadata.
  auto* metadata = static_cast<torch::autograd::PyAnomalyMetadata*>(node->metadata());
  if (metadata == nullptr || metadata->dict() == nullptr) {
    return out;
  }
  PyObject* stack =
      PyDict_GetItemString(metadata->dict(), torch::autograd::PyAnomalyMetadata::ANOMALY_TRACE_KEY);
  if (stack == nullptr || !PyList_Check(stack)) {
    return out;
  }
  for (Py_ssize_t i = 0; i < PyList_Size(stack); ++i) {
    PyObject* line = PyList_GetItem(stack, i);
    if (line != nullptr && PyUnicode_Check(line)) {
      out.emplace_back(PyUnicode_AsUTF8(line));
    }
  }
  return out;
}

sim::Site gather_python_site() {
  if (!Py_IsInitialized()) {
    return nullptr;
  }
  auto site = std::make_shared<PythonSite>();
  // A thread that never ran Python (a stream's thread, an engine thread, a C++ thread) has no
  // frames to gather; asking for the GIL there would only make a thread state for nothing.
  if (PyGILState_GetThisThreadState() != nullptr) {
    site->traceback = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false,
                                                       /*cpp=*/false);
  }
  if (auto node = torch::autograd::get_current_node()) {
    site->backward_of = node->name();
    if (torch::autograd::AnomalyMode::is_enabled()) {
      py::gil_scoped_acquire gil;  // an engine thread: the thread that called backward() waits
      site->forward_stack = forward_stack_of(node);
    }
  } else if (site->traceback == nullptr) {
    return nullptr;
  }
  return site;
}

// The stack of `s`, innermost frame first: (filename, line, function) per frame.
std::vector<std::tuple<std::string, uint64_t, std::string>> site_stack(const sim::Site& s) {
  std::vector<std::tuple<std::string, uint64_t, std::string>> out;
  const auto* site = dynamic_cast<const PythonSite*>(s.get());
  if (site == nullptr || site->traceback == nullptr) {
    return out;
  }
  const torch::SymbolizedTracebacks symbolized = torch::symbolize({site->traceback.get()});
  for (const uint64_t i : symbolized.tracebacks.at(0)) {
    const auto& f = symbolized.all_frames.at(i);
    out.emplace_back(f.filename, f.lineno, f.funcname);
  }
  return out;
}

// (node name, forward stack as text) for an access of a backward pass; None otherwise.
py::object site_backward(const sim::Site& s) {
  const auto* site = dynamic_cast<const PythonSite*>(s.get());
  if (site == nullptr || site->backward_of.empty()) {
    return py::none();
  }
  return py::make_tuple(site->backward_of, site->forward_stack);
}

}  // namespace

void init_sim_bindings(py::module& m) {
  g_race_error = PyErr_NewExceptionWithDoc(
      "torch_pipeline.sim.RaceError",
      "An op on the sim device raced with an earlier access of the same memory (strict mode).",
      PyExc_RuntimeError, nullptr);
  if (g_race_error == nullptr) {
    throw py::error_already_set();
  }
  m.attr("SimRaceError") = py::reinterpret_borrow<py::object>(g_race_error);
  sim::set_race_thrower(&throw_race_error);
  PyObject* bases = Py_BuildValue("(OO)", PyExc_ValueError, PyExc_RuntimeError);
  g_device_index_error =
      bases == nullptr ? nullptr
                       : PyErr_NewExceptionWithDoc("torch_pipeline.sim.DeviceIndexError",
                                                   "A sim device index out of range: a ValueError, "
                                                   "and a RuntimeError as CUDA's invalid ordinal.",
                                                   bases, nullptr);
  Py_XDECREF(bases);
  if (g_device_index_error == nullptr) {
    throw py::error_already_set();
  }
  m.attr("SimDeviceIndexError") = py::reinterpret_borrow<py::object>(g_device_index_error);
  sim::set_device_index_thrower(&throw_device_index_error);

  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const RaceErrorPy& e) {
      PyErr_SetString(g_race_error, e.what());
    } catch (const DeviceIndexErrorPy& e) {
      PyErr_SetString(g_device_index_error, e.what());
    } catch (const sim::RaceError& e) {
      PyErr_SetString(g_race_error, e.what_without_backtrace());
    }
  });

  py::class_<sim::Race>(m, "SimRace", R"doc(
A race found by the sim device's checker: an access (`later_*`) not ordered after a conflicting
earlier access (`earlier_*`) of the same bytes on another stream. str(race) names both ops, their
streams and the memory.
)doc")
      .def_readonly("memory", &sim::Race::memory,
                    "The storage, e.g. 'sim:0 storage 0x... (64 bytes)'.")
      .def_readonly("begin", &sim::Race::begin, "First byte address of the overlap.")
      .def_readonly("end", &sim::Race::end, "One past the last byte address of the overlap.")
      .def_readonly("earlier_op", &sim::Race::earlier_op)
      .def_readonly("earlier_stream", &sim::Race::earlier_timeline)
      .def_readonly("earlier_write", &sim::Race::earlier_write)
      .def_readonly("later_op", &sim::Race::later_op)
      .def_readonly("later_stream", &sim::Race::later_timeline)
      .def_readonly("later_write", &sim::Race::later_write)
      .def_property_readonly(
          "earlier_stack", [](const sim::Race& r) { return site_stack(r.earlier_site); },
          "The Python stack that made the earlier access, innermost first: (file, line, "
          "function) per frame; empty unless sites were on (set_report_stacks).")
      .def_property_readonly(
          "later_stack", [](const sim::Race& r) { return site_stack(r.later_site); },
          "The same for the later access.")
      .def_property_readonly(
          "earlier_backward", [](const sim::Race& r) { return site_backward(r.earlier_site); },
          "For an earlier access made by a backward pass: (autograd node name, the forward's "
          "stack as traceback.format_stack() text, when the forward ran in anomaly mode); "
          "None otherwise.")
      .def_property_readonly(
          "later_backward", [](const sim::Race& r) { return site_backward(r.later_site); },
          "The same for the later access.")
      .def("__str__", &sim::Race::to_string)
      .def("__repr__",
           [](const sim::Race& r) { return "<torch_pipeline.sim.Race " + r.to_string() + ">"; });

  m.def(
      "_sim_enable", [](int num_devices, bool strict) { sim::enable(num_devices, strict); },
      py::arg("num_devices"), py::arg("strict"));
  m.def("_sim_enabled", &sim::enabled);
  m.def("_sim_num_devices", &sim::num_devices);
  m.def("_sim_races", &sim::races);
  m.def("_sim_clear_races", &sim::clear_races);
  m.def("_sim_trace_start", &sim::trace::start);
  m.def("_sim_trace_now_ns", &sim::trace::now_ns);
  m.def("_sim_trace_stop", [] {
    // (kind, stream label, name, begin_ns, end_ns, from label, from_ns); kind 0 kernel, 1 wait
    std::vector<py::tuple> out;
    const auto events = sim::trace::stop();
    auto& checker = sim::State::get().checker();
    for (const auto& e : events) {
      out.push_back(py::make_tuple(
          static_cast<int>(e.kind), checker.label(e.timeline), e.name, e.begin_ns, e.end_ns,
          e.kind == sim::trace::Event::kWait ? checker.label(e.from) : std::string(), e.from_ns));
    }
    return out;
  });
  m.def("_sim_set_strict", &sim::set_strict, py::arg("strict"));
  sim::set_site_gatherer(&gather_python_site);
  m.def("_sim_set_record_sites", &sim::set_record_sites, py::arg("on"));
  m.def("_sim_record_sites", &sim::record_sites);
  m.def(
      "_sim_name_storages",
      [](const std::vector<std::pair<at::Tensor, std::string>>& named) {
        for (const auto& [t, name] : named) {
          if (sim::is_sim(t) && t.has_storage() && t.storage().data() != nullptr) {
            sim::StorageNames::get().set(t.storage().data(), name);
          }
        }
      },
      py::arg("named"),
      "Names the storages of these sim tensors in race reports (module parameters and buffers).");
  m.def("_sim_strict", &sim::strict);
  m.def(
      "_sim_synchronize",
      [](int device) {
        ReleasedGil no_gil;  // asynchronous mode: waits for the streams' threads
        sim::synchronize(device);
      },
      py::arg("device"));
  m.def("_sim_history_size", &sim::history_size);
  m.def("_sim_raw_kernel", &sim::raw_kernel, py::arg("name"), py::arg("reads"), py::arg("writes"));
  m.def("_sim_pending_host_accesses", &sim::pending_host_accesses);
  m.def("_sim_host_memory_stats", &sim::host_memory_stats);
  m.def("_sim_empty_host_cache", &sim::empty_host_cache);
  m.def("_sim_stream_from_pool", &sim::stream_from_pool, py::arg("device"),
        py::arg("high_priority") = false);
  m.def("_sim_stream_priority", &sim::stream_priority, py::arg("stream"));
  m.def("_sim_stream_label", &sim::stream_label, py::arg("stream"));
  m.def("_sim_op_facts", &op_facts_dict, py::arg("name"));
  m.def("_sim_op_facts_observed", &op_facts_observed, py::arg("fn"));
  m.def(
      "_sim_set_asynchronous",
      [](bool on) {
        ReleasedGil no_gil;  // switching off waits for the queues
        sim::set_asynchronous(on);
      },
      py::arg("on"));
  m.def("_sim_asynchronous", &sim::asynchronous);
  m.def("_sim_shutdown_executors", [] {
    ReleasedGil no_gil;
    sim::shutdown_executors();
  });
  m.def("_sim_running_executors", &sim::running_executors);
  m.def("_sim_set_latency", &sim::set_latency, py::arg("launch_us"), py::arg("bandwidth_gbps"));
  m.def("_sim_latency", [] {
    const sim::LatencyModel l = sim::latency();
    return std::make_pair(l.launch_us, l.bandwidth_gbps);
  });
  m.def("_sim_set_op_latency", &sim::set_op_latency, py::arg("op"), py::arg("us"));
  m.def("_sim_clear_op_latencies", &sim::clear_op_latencies);
  m.def("_sim_op_lists", [] {
    py::dict d;
    d["no_data"] = no_data_ops();
    d["host_sync"] = host_sync_ops();
    return d;
  });
  // The capture twin (csrc/sim/graph_capture.h).
  py::class_<sim::Graph, std::shared_ptr<sim::Graph>>(m, "_SimGraph")
      .def("replay", &sim::Graph::replay, py::arg("stream"))
      .def_property_readonly("accesses", &sim::Graph::accesses)
      .def_property_readonly("captured_ops", &sim::Graph::captured_ops)
      .def_property_readonly("eager_ops", &sim::Graph::eager_ops);
  m.def("_sim_begin_capture", &sim::begin_capture, py::arg("stream"));
  m.def("_sim_end_capture", &sim::end_capture, py::arg("stream"));
  m.def("_sim_capture_probes", &sim::probe_calls,
        "How often the tracker asked the sim device whether a stream is capturing.");
  m.def(
      "_sim_capture_of",
      [](const c10::Stream& s) { return sim::capture_of(sim::State::get().timeline(s)); },
      py::arg("stream"));
}

}  // namespace python
}  // namespace torch_pipeline
