#include "sim_bindings.h"

#include "../sim/sim.h"

#include <torch/csrc/Exceptions.h>

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
  PyObject* python_type() override {
    return g_race_error;
  }
};

void throw_race_error(const std::string& message) {
  throw RaceErrorPy(message);
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

  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const RaceErrorPy& e) {
      PyErr_SetString(g_race_error, e.what());
    } catch (const sim::RaceError& e) {
      PyErr_SetString(g_race_error, e.what_without_backtrace());
    }
  });

  py::class_<sim::Race>(m, "SimRace", R"doc(
A race found by the sim device's checker: an access (`later_*`) not ordered after a conflicting
earlier access (`earlier_*`) of the same bytes on another stream. str(race) names both ops, their
streams and the memory.
)doc")
      .def_readonly("memory", &sim::Race::memory, "The storage, e.g. 'sim:0 storage 0x... (64 bytes)'.")
      .def_readonly("begin", &sim::Race::begin, "First byte address of the overlap.")
      .def_readonly("end", &sim::Race::end, "One past the last byte address of the overlap.")
      .def_readonly("earlier_op", &sim::Race::earlier_op)
      .def_readonly("earlier_stream", &sim::Race::earlier_timeline)
      .def_readonly("earlier_write", &sim::Race::earlier_write)
      .def_readonly("later_op", &sim::Race::later_op)
      .def_readonly("later_stream", &sim::Race::later_timeline)
      .def_readonly("later_write", &sim::Race::later_write)
      .def("__str__", &sim::Race::to_string)
      .def("__repr__", [](const sim::Race& r) { return "<torch_pipeline.sim.Race " + r.to_string() + ">"; });

  m.def("_sim_enable", [](int num_devices, bool strict) {
    sim::enable(num_devices, strict);
  }, py::arg("num_devices"), py::arg("strict"));
  m.def("_sim_enabled", &sim::enabled);
  m.def("_sim_num_devices", &sim::num_devices);
  m.def("_sim_races", &sim::races);
  m.def("_sim_clear_races", &sim::clear_races);
  m.def("_sim_set_strict", &sim::set_strict, py::arg("strict"));
  m.def("_sim_strict", &sim::strict);
  m.def("_sim_synchronize", &sim::synchronize, py::arg("device"));
  m.def("_sim_history_size", &sim::history_size);
  m.def("_sim_raw_kernel", &sim::raw_kernel, py::arg("name"), py::arg("reads"), py::arg("writes"));
  m.def("_sim_pending_host_accesses", &sim::pending_host_accesses);
  m.def("_sim_stream_from_pool", &sim::stream_from_pool, py::arg("device"),
        py::arg("high_priority") = false);
  m.def("_sim_stream_priority", &sim::stream_priority, py::arg("stream"));
  m.def("_sim_stream_label", &sim::stream_label, py::arg("stream"));
}

}  // namespace python
}  // namespace torch_pipeline
