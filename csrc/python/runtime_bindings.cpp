// Bindings of events, task futures, communication streams, automatic synchronization and
// settings: argument checking and conversion only; the behaviour is in csrc/runtime.
#include "bindings.h"
#include "convert.h"
#include "gil.h"
#include "tasks.h"
#include "threads.h"

#include "../runtime/comm.h"
#include "../runtime/devices.h"
#include "../runtime/event.h"
#include "../runtime/host_waits.h"
#include "../runtime/op_facts.h"
#include "../runtime/runtime.h"
#include "../runtime/saved_original.h"
#include "../runtime/settings.h"
#include "../runtime/streams.h"
#include "../runtime/task.h"
#include "../runtime/tracking.h"

#include <ATen/record_function.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/jit/api/object.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <sstream>

namespace py = pybind11;

namespace torch_pipeline {
namespace python {

void bind_runtime(py::module_& m) {
  // ---- events --------------------------------------------------------------------------------
  py::class_<PipelineEvent, std::shared_ptr<PipelineEvent>>(m, "PipelineEvent", R"doc(
A cross-device event: record() captures a pipeline's position on each of its devices; wait()
makes another pipeline's stream on each of those devices wait for it.

    >>> e = producer.record_event()      # or torch_pipeline.PipelineEvent().record(producer)
    >>> consumer.wait_event(e)
)doc")
      .def(py::init([](py::handle enable_timing) {
             TORCH_CHECK_TYPE(PyBool_Check(enable_timing.ptr()),
                              "enable_timing must be True or False, got an "
                              "object of type ",
                              type_name(enable_timing));
             return std::make_shared<PipelineEvent>(enable_timing.ptr() == Py_True);
           }),
           py::kw_only(), py::arg("enable_timing") = false)
      .def(
          "record",
          [](PipelineEvent& e, py::handle p) {
            e.record(*to_pipeline_or_current(p, "PipelineEvent.record"));
          },
          py::arg("pipeline") = py::none(),
          "Records `pipeline`'s position (default: the current "
          "pipeline's) on each of its devices.")
      .def(
          "wait",
          [](const PipelineEvent& e, py::handle p) {
            e.wait(*to_pipeline_or_current(p, "PipelineEvent.wait"));
          },
          py::arg("pipeline") = py::none(),
          "Makes `pipeline`'s streams (default: the current "
          "pipeline's) wait for this event.")
      .def("query", &PipelineEvent::query, "Whether the recorded work is complete.")
      .def(
          "synchronize",
          [](const PipelineEvent& e) {
            block_until([&e](std::chrono::milliseconds) {
              e.synchronize();
              return true;
            });
          },
          "Blocks until the recorded work is complete.")
      .def(
          "elapsed_time",
          [](const PipelineEvent& e, py::handle end, py::handle device) {
            const auto d = to_accelerator_device(device);
            TORCH_CHECK_VALUE(d.has_value(), "elapsed_time needs an accelerator device");
            TORCH_CHECK_TYPE(py::isinstance<PipelineEvent>(end),
                             "elapsed_time expects a "
                             "torch_pipeline.PipelineEvent, got an object of type ",
                             type_name(end));
            return e.elapsed_time(py::cast<const PipelineEvent&>(end), *d);
          },
          py::arg("end_event"), py::arg("device") = py::none(), R"doc(
Milliseconds from this event to ``end_event`` on ``device`` (default: the current accelerator
device); both need enable_timing=True.

    >>> start = torch_pipeline.PipelineEvent(enable_timing=True)
    >>> end = torch_pipeline.PipelineEvent(enable_timing=True)
    >>> start.record(p); work(); end.record(p); end.synchronize()
    >>> ms = start.elapsed_time(end)
)doc")
      .def_property_readonly("enable_timing", &PipelineEvent::enable_timing)
      .def_property_readonly("devices", &PipelineEvent::devices)
      .def("__repr__", [](const PipelineEvent& e) {
        std::ostringstream os;
        os << "<torch_pipeline.PipelineEvent devices=[";
        const auto devices = e.devices();
        for (size_t i = 0; i < devices.size(); ++i) {
          os << (i ? ", " : "") << devices[i];
        }
        os << "]>";
        return os.str();
      });

  // ---- tasks ---------------------------------------------------------------------------------
  py::class_<TaskSync, std::shared_ptr<TaskSync>>(m, "_TaskSync")
      .def("done", &TaskSync::done)
      .def("wait", &wait_task);

  m.def("_set_future_class", &set_future_class);
  m.def("_set_decorate", &set_decorate);
  m.def("_set_work_hooks_installer", &set_work_hooks_installer);
  m.def("_set_graph_hooks_installer", &set_graph_hooks_installer);
  m.def("_shutdown", &shutdown, py::arg("timeout_s") = -1.0);
  m.def("_refresh_accelerator", &refresh_accelerator);
  m.def("_current_accelerator_device", []() -> py::object {
    const auto acc = accelerator();
    if (!acc.has_value()) {
      return py::none();
    }
    return py::cast(current_device(*acc));
  });
  m.def("_generation", &Runtime::current_generation);

  // ---- settings (csrc/runtime/settings.h) ------------------------------------------------------
  m.def(
      "_env_seconds",
      [](const std::string& name) -> py::object {
        const auto v = settings::env_seconds(name.c_str());
        return v.has_value() ? py::object(py::float_(*v)) : py::none();
      },
      py::arg("name"),
      "A number of seconds >= 0 from environment variable `name`, or None when "
      "unset (ValueError naming it otherwise).");
  m.def(
      "_env_flag",
      [](const std::string& name, bool fallback) {
        return settings::env_flag(name.c_str(), fallback);
      },
      py::arg("name"), py::arg("default"),
      "A 0/1 flag from environment variable `name`, or "
      "`default` when unset (ValueError naming it otherwise).");

  // ---- communication streams (comm.h) ----
  py::class_<CollectiveGuard>(m, "_CollectiveGuard")
      .def(py::init<>(), py::call_guard<PythonWarnings>());
  m.def(
      "_comm_stream",
      [](py::handle device, py::handle worker_thread) -> py::object {
        const auto d = to_accelerator_device(device);
        if (!d.has_value()) {
          return py::none();
        }
        const int worker =
            worker_thread.is_none() ? collective_worker() : to_worker_id(worker_thread);
        return to_python_stream(comm_stream(worker, *d));
      },
      py::arg("device"), py::arg("worker_thread"));
  m.def("_collective_worker", &collective_worker);
  m.def("_set_collective_debug", &set_collective_debug, py::arg("on"));
  m.def("_collective_debug", &collective_debug);
  m.def("_collective_hazards", &collective_hazards);
  m.def("_clear_collective_hazards", &clear_collective_hazards);

  // ---- automatic synchronization (tracking) ----
  py::class_<tracking::TrackScope>(m, "_TrackScope")
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&>(),
           py::arg("reads"), py::arg("writes"), py::call_guard<ReleasedGil>());
  py::class_<tracking::StorageResize>(m, "_StorageResize")
      .def(py::init([](py::handle storage) {
             TORCH_CHECK_TYPE(THPStorage_Check(storage.ptr()), "_StorageResize expects a storage");
             c10::Storage s = THPStorage_Unpack(reinterpret_cast<THPStorage*>(storage.ptr()));
             ReleasedGil nogil;  // (it may wait for a task pinning the storage)
             return std::make_unique<tracking::StorageResize>(s);
           }),
           py::arg("storage"))
      .def("done", &tracking::StorageResize::done, py::call_guard<ReleasedGil>());
  py::class_<tracking::CompiledRegion>(m, "_CompiledRegion")
      .def(py::init<const std::vector<at::Tensor>&>(), py::arg("args"),
           py::call_guard<ReleasedGil>())
      .def("outputs", &tracking::CompiledRegion::outputs, py::arg("outs"))
      .def("close", &tracking::CompiledRegion::close, py::call_guard<ReleasedGil>());
  m.def("_set_regions_wrapped", &tracking::set_regions_wrapped, py::arg("wrapped"));
  m.def("_set_dynamo_loaded", &tracking::set_dynamo_loaded);
  m.def("_tracking_live", &tracking::live);
  py::class_<SavedOriginal>(m, "_SavedOriginal")
      .def(py::init<const at::Tensor&>(), py::arg("tensor"))
      .def("get", &SavedOriginal::get)
      .def("modified", &SavedOriginal::modified);
  m.def("_slot_streams", [] {
    // (worker thread, priority, slot, torch.Stream) of every pipeline slot's streams.
    std::vector<py::tuple> out;
    for (const auto& s : Runtime::get().slot_streams()) {
      out.push_back(py::make_tuple(s.worker_id, s.priority, s.slot, to_python_stream(s.stream)));
    }
    return out;
  });
  m.def(
      "_set_record_function_enabled",
      [](bool enabled) {
        at::enableRecordFunction(enabled);
        tracking::set_thread_hidden(!enabled);
      },
      py::arg("enabled"),
      "Test switch: False turns RecordFunction off on this thread and hides its ops from the "
      "dispatcher path, so the ops it runs are as invisible to the tracker as kernels launched "
      "outside the dispatcher (Triton's). Not for production code.");
  m.def(
      "_set_tracking_enabled",
      [](bool enabled) {
        {
          ReleasedGil no_gil;
          tracking::set_enabled(enabled);
        }
        observe_python_threads();
      },
      py::arg("enabled"),
      "Test switch: False stops automatic synchronization (tests use it to show the races it "
      "removes). Not for production code.");
  m.def("_observer_key_state", &tracking::observer_key_state,
        "(included, excluded): whether this thread carries the dispatcher path's key (tests).");
  m.def("_range_check_installed", &tracking::range_check_installed,
        "Whether the dispatcher path's check of Dynamo's ranges is installed (tests).");
  m.def("_forget_this_thread", &tracking::forget_this_thread,
        "Test switch: the calling thread drops the dispatcher path's key, as a thread the "
        "runtime never knew.");
  m.def("_set_unobserved_checks", &tracking::set_unobserved_checks, py::arg("sampling"),
        py::arg("backend"),
        "Test switch: the share of RecordFunction events the sampled check of threads without "
        "the key sees (from the next go-live), and whether backends check their device ops "
        "(off: the sampled check is installed for every device type).");
  m.def("_sampled_check_installed", &tracking::sampled_check_installed,
        "Whether the dispatcher path's sampled RecordFunction check of threads without the key "
        "is installed (only while the live period has a stream of a device type whose backend "
        "does not check its device ops).");
  m.def("_observe_this_thread", &tracking::observe_this_thread,
        "The calling thread is observed by the dispatcher path while tracking is live "
        "(torch_pipeline/_threads.py calls it when a thread starts).");
  m.def(
      "_set_observer",
      [](const std::string& name) {
        TORCH_CHECK_VALUE(name == "dispatcher" || name == "record_function",
                          "the observer must be 'dispatcher' or 'record_function', got '", name,
                          "'");
        tracking::set_observer(name == "dispatcher" ? tracking::Observer::kDispatcher
                                                    : tracking::Observer::kRecordFunction);
      },
      py::arg("name"),
      "Chooses how ops are observed from the next time tracking goes live (tests and "
      "benchmarks; TORCH_PIPELINE_OBSERVER sets it for a process).");
  m.def("_observer", [] {
    return tracking::observer() == tracking::Observer::kDispatcher ? "dispatcher"
                                                                   : "record_function";
  });
  m.def("_tracking_enabled", &tracking::enabled);
  m.def(
      "_work_waited",
      [](py::handle work) {
        // After Work.wait() / synchronize() / block_current_stream() (hooked by torch_pipeline).
        if (!tracking::live()) {
          return;
        }
        const py::object boxed = work.attr("boxed")();  // the Work as a torchbind object
        const c10::IValue v(py::cast<torch::jit::Object>(boxed)._ivalue());
        const void* target = torchbind_target(v);
        ReleasedGil no_gil;
        tracking::work_waited(target);
      },
      py::arg("work"));
  m.def(
      "_set_allocator_safety",
      [](const std::string& mode) {
        TORCH_CHECK_VALUE(mode == "keep_alive" || mode == "record_stream",
                          "allocator safety must be 'keep_alive' or 'record_stream', got '", mode,
                          "'");
        tracking::set_allocator_safety(mode == "keep_alive"
                                           ? tracking::AllocatorSafety::kKeepAlive
                                           : tracking::AllocatorSafety::kRecordStream);
      },
      py::arg("mode"),
      "Chooses how memory used off its allocation stream is kept from reuse "
      "(bench/bench_allocator.py compares the two).");
  m.def("_allocator_safety", [] {
    return tracking::allocator_safety() == tracking::AllocatorSafety::kKeepAlive ? "keep_alive"
                                                                                 : "record_stream";
  });
  m.def(
      "_tracking_stats",
      [] {
        const tracking::Stats s = tracking::stats();
        py::dict d;
        d["live"] = s.live;
        d["ops"] = s.ops;
        d["launches"] = s.launches;
        d["waits"] = s.waits;
        d["events"] = s.events;
        d["host_waits"] = s.host_waits;
        d["record_streams"] = s.record_streams;
        d["pin_waits"] = s.pin_waits;
        d["keep_alives"] = s.keep_alives;
        d["released"] = s.released;
        d["kept_alive"] = s.kept_alive;
        d["kept_alive_bytes"] = s.kept_alive_bytes;
        d["storages"] = s.storages;
        d["streams"] = s.streams;
        d["unclaimed"] = s.unclaimed;
        d["compiled_regions"] = s.compiled_regions;
        d["compiled_unwrapped"] = s.compiled_unwrapped;
        d["gaps"] = s.gaps;
        d["captures"] = s.captures;
        d["captures_underway"] = s.captures_underway;
        d["queries_paused"] = s.queries_paused;
        d["capture_forks"] = s.capture_forks;
        d["capture_joins"] = s.capture_joins;
        d["capture_kept"] = s.capture_kept;
        d["graph_replays"] = s.graph_replays;
        d["polls_paused"] = s.polls_paused;
        d["unobserved"] = s.unobserved;
        d["observer"] = s.observer;
        py::list gap_ops;
        for (const std::string& name : s.gap_ops) {
          gap_ops.append(py::str(name));
        }
        d["gap_ops"] = gap_ops;
        return d;
      },
      "Counters of automatic synchronization (torch_pipeline.tracking_stats()).");
  m.def(
      "_tracker_parts",
      [] {
        const tracking::PartsSnapshot s = tracking::parts_snapshot();
        auto part = [](std::initializer_list<std::pair<const char*, uint64_t>> fields) {
          py::dict d;
          for (const auto& [name, value] : fields) {
            d[name] = value;
          }
          return d;
        };
        py::dict d;
        d["period"] = s.period;
        d["tracker"] = part({{"storages", s.tracker_storages},
                             {"records", s.tracker_records},
                             {"history", s.tracker_history}});
        d["streams"] = part({{"entries", s.stream_entries},
                             {"in_flight", s.streams_in_flight},
                             {"events", s.stream_events}});
        d["storages"] =
            part({{"entries", s.storage_entries}, {"young", s.young}, {"sweeps", s.sweeps}});
        d["kept"] =
            part({{"count", s.kept}, {"queued", s.kept_queued}, {"streams", s.kept_streams}});
        d["async_works"] = part({{"works", s.async_works}});
        return d;
      },
      "What each part of the tracker's state holds now (tests of the parts, bug reports).");
  m.def("_cuda_exclusive_streams", [] { return has_exclusive_streams(c10::kCUDA); });
}

}  // namespace python
}  // namespace torch_pipeline
