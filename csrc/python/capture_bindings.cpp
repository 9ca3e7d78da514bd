// Graph capture (docs/design.md, "Graph capture"): the hooks torch_pipeline/_graphs.py calls
// around a capture's begin and end, the captured graph it attaches to the graph object, and
// replays. Binds tracking.h only.
#include "bindings.h"
#include "gil.h"

#include "../runtime/tracking.h"

#include <memory>

namespace py = pybind11;

namespace torch_pipeline {
namespace python {

void bind_capture(py::module_& m) {
  using tracking::CapturedGraph;
  using tracking::CaptureHandle;
  using tracking::GraphReplay;
  py::class_<CaptureHandle, std::shared_ptr<CaptureHandle>>(
      m, "_CaptureHandle",
      "A graph capture the tracker follows, from capture_begun to capture_ended (kept on the "
      "graph object, so the capture may end on another thread).");
  py::class_<CapturedGraph, std::shared_ptr<CapturedGraph>>(
      m, "_CapturedGraph",
      "What a captured graph keeps for its lifetime, and how its replays are ordered.")
      .def_property_readonly("kept", &CapturedGraph::kept,
                             "Storages kept alive for the graph's lifetime.")
      .def("reset", &CapturedGraph::reset, py::call_guard<ReleasedGil>())
      .def(
          "replay", [](const CapturedGraph& g) { return std::make_unique<GraphReplay>(g); },
          py::call_guard<ReleasedGil>(),
          "Opens a replay on the current streams (close() it after the replay).");
  py::class_<GraphReplay>(m, "_GraphReplay")
      .def("close", &GraphReplay::close, py::call_guard<ReleasedGil>());
  m.def("_capture_prepare", &tracking::capture_prepare, py::arg("stream"),
        py::call_guard<ReleasedGil>());
  m.def("_capture_begun", &tracking::capture_begun, py::arg("stream"),
        py::call_guard<ReleasedGil>());
  m.def("_capture_abandoned", &tracking::capture_abandoned, py::call_guard<ReleasedGil>());
  m.def(
      "_capture_join_back",
      [](const CaptureHandle* capture) { return tracking::capture_join_back(capture); },
      py::arg("capture").none(true), py::call_guard<ReleasedGil>());
  m.def(
      "_capture_ended",
      [](const CaptureHandle* capture) { return tracking::capture_ended(capture); },
      py::arg("capture").none(true), py::call_guard<ReleasedGil>());
  m.def("_set_capture_aware", &tracking::set_capture_aware, py::arg("aware"),
        "Test switch: False makes the tracker ignore graph captures (polls do not pause, "
        "captured ops are tracked as if they ran), so tests show what goes wrong. Not for "
        "production code.");
}

}  // namespace python
}  // namespace torch_pipeline
