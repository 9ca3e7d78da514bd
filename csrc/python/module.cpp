// torch_pipeline._C: the Python bindings. Only argument checking and conversion live here; the
// behaviour is in csrc/runtime (and csrc/python/tasks.cpp for Python tasks).
#include "gil.h"
#include "sim_bindings.h"
#include "tasks.h"

#include "../runtime/comm.h"
#include "../runtime/context.h"
#include "../runtime/devices.h"
#include "../runtime/op_facts.h"
#include "../runtime/event.h"
#include "../runtime/runtime.h"
#include "../runtime/tracking.h"
#include "../runtime/streams.h"

#include <torch/csrc/jit/api/object.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <sstream>

namespace py = pybind11;
using namespace torch_pipeline;

namespace {

// A worker-thread handle: only get_worker_thread(i) makes them (the id is checked there).
struct WorkerThreadHandle {
  int id;
};

// What tp.pipeline(None) returns, like torch.cuda.stream(None): a no-op.
struct NoPipeline {};

// torch_pipeline._decorate(pipeline_or_None, fn); leaked so that no destructor runs after the
// interpreter is gone.
py::object* g_decorate = nullptr;
py::object* g_no_pipeline = nullptr;  // the NoPipeline instance

std::string type_name(py::handle obj) {
  return Py_TYPE(obj.ptr())->tp_name;
}

PipelinePtr to_pipeline(py::handle obj, const char* what) {
  TORCH_CHECK_TYPE(
      py::isinstance<PipelineImpl>(obj), what, " expects a torch_pipeline.Pipeline, got an object "
      "of type ", type_name(obj));
  return py::cast<PipelinePtr>(obj);
}

PipelinePtr to_pipeline_or_current(py::handle obj, const char* what) {
  return obj.is_none() ? current_pipeline() : to_pipeline(obj, what);
}

bool is_int(py::handle obj) {
  return PyLong_Check(obj.ptr()) && !PyBool_Check(obj.ptr());  // bool is an int to Python
}

// The value of a Python int if it is in [lo, hi], else nullopt (also when it overflows).
std::optional<long long> int_in_range(py::handle obj, long long lo, long long hi) {
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(obj.ptr(), &overflow);
  if (overflow != 0 || v < lo || v > hi) {
    return std::nullopt;
  }
  return v;
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
  TORCH_CHECK_VALUE(
      id.has_value(), "worker thread id ", py::str(obj).cast<std::string>(),
      " is out of range: the cap is ", max_worker_threads(), " worker threads (ids 0..",
      max_worker_threads() - 1, ")");
  return static_cast<int>(*id);
}

c10::Device to_device(py::handle obj) {
  TORCH_CHECK_TYPE(
      THPDevice_Check(obj.ptr()), "expected a torch.device, got an object of type ",
      type_name(obj));
  return reinterpret_cast<THPDevice*>(obj.ptr())->device;
}

std::string pipeline_repr(const PipelineImpl& p) {
  std::ostringstream os;
  if (p.is_default()) {
    os << "<torch_pipeline.Pipeline default (worker_thread=0)>";
    return os.str();
  }
  os << "<torch_pipeline.Pipeline id=" << p.id() << " worker_thread=" << p.worker_id()
     << " priority=" << p.priority();
  for (const auto& [device, stream] : p.own_streams()) {
    os << " " << device << ":stream=" << stream.id();
  }
  os << ">";
  return os.str();
}

void synchronize_streams(const DeviceStreams& streams) {
  py::gil_scoped_release no_gil;
  for (const auto& [device, stream] : streams) {
    c10::impl::getDeviceGuardImpl(device.type())->synchronizeStream(stream);
  }
}

// The streams a pipeline has now, without acquiring new ones.
DeviceStreams existing_streams(PipelineImpl& p) {
  return p.is_default() ? lane_streams(p) : p.own_streams();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_pipeline native runtime (use the torch_pipeline package, not this module)";

  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  Runtime::set_idle_hook(&python::worker_release_gil);
  python::install_terminate_handler();

  // ---- worker threads ----------------------------------------------------------------------
  py::class_<WorkerThreadHandle>(m, "WorkerThread", R"doc(
A long-lived worker thread of torch_pipeline's capped pool. Get one with get_worker_thread(i).

    >>> t = torch_pipeline.get_worker_thread(1)
    >>> p = torch_pipeline.Pipeline(t)
)doc")
      .def(py::init([](py::args, py::kwargs) -> WorkerThreadHandle {
        TORCH_CHECK_TYPE(
            false, "WorkerThread objects are not created directly: use "
            "torch_pipeline.get_worker_thread(i)");
        return {};
      }))
      .def_property_readonly("id", [](const WorkerThreadHandle& t) { return t.id; })
      .def("__eq__", [](const WorkerThreadHandle& a, py::handle b) {
        return py::isinstance<WorkerThreadHandle>(b) && py::cast<WorkerThreadHandle&>(b).id == a.id;
      })
      .def("__hash__", [](const WorkerThreadHandle& t) { return py::hash(py::int_(t.id)); })
      .def("__repr__", [](const WorkerThreadHandle& t) {
        return "<torch_pipeline.WorkerThread id=" + std::to_string(t.id) + ">";
      });

  m.def("get_worker_thread", [](py::handle id) {
    TORCH_CHECK_TYPE(
        is_int(id), "get_worker_thread expects an int id, got an object of type ", type_name(id));
    const int i = to_worker_id(id);
    Runtime::get().check_worker_id(i);
    return WorkerThreadHandle{i};
  }, py::arg("id"), "The handle of worker thread `id` (0 <= id < max_worker_threads()).");
  m.def("max_worker_threads", &max_worker_threads, "The worker-thread cap (default 4).");
  m.def("set_max_worker_threads", [](py::handle n) {
    TORCH_CHECK_TYPE(
        is_int(n), "set_max_worker_threads expects an int, got an object of type ", type_name(n));
    const auto v = int_in_range(n, 1, kMaxWorkerThreadsLimit);
    TORCH_CHECK_VALUE(
        v.has_value(), "max worker threads must be in [1, ", kMaxWorkerThreadsLimit, "], got ",
        py::str(n).cast<std::string>());
    set_max_worker_threads(static_cast<int>(*v));
  }, py::arg("n"), "Sets the worker-thread cap; only before the first Pipeline, get_worker_thread "
     "or submit.");

  // ---- pipelines -----------------------------------------------------------------------------
  py::class_<PipelineImpl, PipelinePtr>(m, "Pipeline", R"doc(
A cross-device lane of streams bound to a worker thread (like torch.cuda.Stream, on every device).

Pipeline(worker_thread=None, *, priority=0): worker_thread is a WorkerThread, its id, or None
(worker thread 0); priority as for torch.cuda.Stream (lower is higher). ``id`` is the pipeline's
slot among the live pipelines of its (worker thread, priority): lifetime-disjoint pipelines reuse
the smallest free slot and its streams.

    >>> p = torch_pipeline.Pipeline()
    >>> with p:                      # p's streams are the current torch streams here
    ...     y = model(x)
    >>> fut = p.submit(torch.add, a, b)   # runs on p's worker thread, under p
    >>> c = fut.wait()
)doc")
      .def(py::init([](py::handle worker_thread, py::handle priority) {
        TORCH_CHECK_TYPE(
            is_int(priority), "priority must be an int, got an object of type ",
            type_name(priority));
        const auto pr = int_in_range(priority, -1024, 1024);
        TORCH_CHECK_VALUE(
            pr.has_value(), "priority must be in [-1024, 1024] (lower is higher "
            "priority, as for torch.cuda.Stream; backends clamp it to their range), got ",
            py::str(priority).cast<std::string>());
        return Runtime::get().create_pipeline(to_worker_id(worker_thread), static_cast<int>(*pr));
      }), py::arg("worker_thread") = py::none(), py::kw_only(), py::arg("priority") = 0)
      .def_property_readonly("id", &PipelineImpl::id)
      .def_property_readonly("worker_thread", [](const PipelineImpl& p) {
        return WorkerThreadHandle{p.worker_id()};
      })
      .def_property_readonly("priority", &PipelineImpl::priority)
      .def_property_readonly("is_default", &PipelineImpl::is_default)
      .def("_stream", [](PipelineImpl& p, py::handle device) {
        return pipeline_stream(p, to_device(device));
      })
      .def("_streams", [](PipelineImpl& p) {
        py::list out;
        for (const auto& ds : existing_streams(p)) {
          out.append(py::cast(ds.second));
        }
        return out;
      })
      .def("query", [](PipelineImpl& p) {
        if (!python::pipeline_tasks_done(p)) {
          return false;
        }
        for (const auto& [device, stream] : existing_streams(p)) {
          if (!c10::impl::getDeviceGuardImpl(device.type())->queryStream(stream)) {
            return false;
          }
        }
        return true;
      })
      .def("synchronize", [](PipelineImpl& p) {
        python::wait_pipeline_tasks(p);
        synchronize_streams(existing_streams(p));
        tracking::poll();  // memory held for uses now complete goes back
      })
      .def("record_event", [](PipelinePtr p, py::object event) {
        if (event.is_none()) {
          event = py::cast(std::make_shared<PipelineEvent>(false));
        }
        TORCH_CHECK_TYPE(
            py::isinstance<PipelineEvent>(event), "record_event expects a "
            "torch_pipeline.PipelineEvent or None, got an object of type ", type_name(event));
        py::cast<PipelineEvent&>(event).record(*p);
        return event;
      }, py::arg("event") = py::none())
      .def("wait_event", [](PipelinePtr p, py::handle event) {
        TORCH_CHECK_TYPE(
            py::isinstance<PipelineEvent>(event), "wait_event expects a "
            "torch_pipeline.PipelineEvent, got an object of type ", type_name(event));
        py::cast<PipelineEvent&>(event).wait(*p);
      }, py::arg("event"))
      .def("wait_pipeline", [](PipelinePtr p, py::handle other) {
        PipelinePtr o = to_pipeline(other, "wait_pipeline");
        if (o.get() == p.get()) {
          return;
        }
        PipelineEvent e(false);
        e.record(*o);
        e.wait(*p);
      }, py::arg("other"))
      // submit(fn, /, *args, **kwargs): fn is taken from *args so that a keyword named "fn"
      // reaches the task.
      .def("submit", [](PipelinePtr p, py::args args, py::kwargs kwargs) {
        TORCH_CHECK_TYPE(
            !args.empty(), "submit() missing the callable to run: submit(fn, /, *args, **kwargs)");
        py::object fn = args[0];
        py::tuple rest = py::reinterpret_steal<py::tuple>(PyTuple_GetSlice(args.ptr(), 1, args.size()));
        return python::submit(p, std::move(fn), std::move(rest), std::move(kwargs));
      })
      .def("__enter__", [](py::object self) {
        enter_pipeline(py::cast<PipelinePtr>(self));
        return self;
      })
      .def("__exit__", [](const PipelineImpl& p, py::handle, py::handle, py::handle) {
        exit_pipeline(&p);
        return false;
      })
      .def("__call__", [](py::object self, py::handle fn) {
        TORCH_INTERNAL_ASSERT(g_decorate != nullptr);
        return (*g_decorate)(self, fn);
      }, "Decorator: `@p` (or `@torch_pipeline.pipeline(p)`) runs the function under p.")
      .def("__eq__", [](const PipelineImpl& a, py::handle b) {
        return py::isinstance<PipelineImpl>(b) && &py::cast<const PipelineImpl&>(b) == &a;
      })
      .def("__hash__", [](const PipelineImpl& p) {
        return std::hash<const void*>()(&p);
      })
      .def("__repr__", &pipeline_repr);

  // tp.pipeline(p) is p itself (a Pipeline is its own context manager and decorator), so that
  // `with tp.pipeline(p):` costs no more than `with p:`; tp.pipeline(None) is a shared no-op.
  py::class_<NoPipeline>(m, "_NoPipeline", "What torch_pipeline.pipeline(None) returns: a no-op "
                                           "context manager and decorator.")
      .def("__enter__", [](const NoPipeline&) { return py::none(); })
      .def("__exit__", [](const NoPipeline&, py::handle, py::handle, py::handle) { return false; })
      .def("__call__", [](const NoPipeline&, py::object fn) {
        TORCH_CHECK_TYPE(
            PyCallable_Check(fn.ptr()), "a pipeline decorator needs a callable, got ",
            type_name(fn));
        return fn;
      })
      .def("__repr__", [](const NoPipeline&) { return "torch_pipeline.pipeline(None)"; });
  g_no_pipeline = new py::object(py::cast(NoPipeline{}));

  m.def("pipeline", [](py::handle p) -> py::object {
    if (p.is_none()) {
      return *g_no_pipeline;
    }
    to_pipeline(p, "torch_pipeline.pipeline()");
    return py::reinterpret_borrow<py::object>(p);
  }, py::arg("pipeline"), R"doc(
Context manager and decorator that makes `pipeline` current, like torch.cuda.stream(s): returns
the pipeline itself (a Pipeline is its own context manager); None gives a no-op.

Entries nest and are undone on exit, also when the body raises.

    >>> with torch_pipeline.pipeline(p):
    ...     y = model(x)
    >>> @torch_pipeline.pipeline(p)
    ... def step(x): ...
)doc");

  m.def("current_pipeline", &current_pipeline,
        "The calling thread's current pipeline (the default pipeline outside any context).");
  m.def("default_pipeline", [] { return Runtime::get().default_pipeline(); },
        "The default pipeline: the current torch streams outside any pipeline context, worker thread 0.");
  m.def("set_pipeline", [](py::handle p) {
    if (!p.is_none()) {
      set_pipeline(to_pipeline(p, "set_pipeline"));
    }
  }, py::arg("pipeline"), "Makes `pipeline` current on this thread without a context to undo "
     "(like torch.cuda.set_stream); None changes nothing.");
  m.def("synchronize", [] {
    python::wait_all_tasks();
    const auto devices = initialized_accelerator_devices();
    py::gil_scoped_release no_gil;
    for (const c10::Device& d : devices) {
      c10::impl::getDeviceGuardImpl(d.type())->synchronizeDevice(d.index());
    }
    tracking::poll();  // memory held for uses now complete goes back
  }, "Waits for every task of every worker thread, then for every initialized accelerator device.");

  // ---- events --------------------------------------------------------------------------------
  py::class_<PipelineEvent, std::shared_ptr<PipelineEvent>>(m, "PipelineEvent", R"doc(
A cross-device event: record() captures a pipeline's position on each of its devices; wait()
makes another pipeline's stream on each of those devices wait for it.

    >>> e = producer.record_event()      # or torch_pipeline.PipelineEvent().record(producer)
    >>> consumer.wait_event(e)
)doc")
      .def(py::init([](bool enable_timing) {
        return std::make_shared<PipelineEvent>(enable_timing);
      }), py::kw_only(), py::arg("enable_timing") = false)
      .def("record", [](PipelineEvent& e, py::handle p) {
        e.record(*to_pipeline_or_current(p, "PipelineEvent.record"));
      }, py::arg("pipeline") = py::none())
      .def("wait", [](const PipelineEvent& e, py::handle p) {
        e.wait(*to_pipeline_or_current(p, "PipelineEvent.wait"));
      }, py::arg("pipeline") = py::none())
      .def("query", &PipelineEvent::query)
      .def("synchronize", &PipelineEvent::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("_elapsed_time", [](const PipelineEvent& e, py::handle end, py::handle device) {
        TORCH_CHECK_TYPE(
            py::isinstance<PipelineEvent>(end), "elapsed_time expects a "
            "torch_pipeline.PipelineEvent, got an object of type ", type_name(end));
        return e.elapsed_time(py::cast<const PipelineEvent&>(end), to_device(device));
      })
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
      .def("wait", [](const TaskSync& s) { python::wait_task(s); });

  m.def("_set_future_class", &python::set_future_class);
  m.def("_set_decorate", [](py::object fn) { g_decorate = new py::object(std::move(fn)); });
  m.def("_shutdown", &python::shutdown, py::arg("timeout_s") = -1.0);
  m.def("_refresh_accelerator", &refresh_accelerator);
  m.def("_current_accelerator_device", []() -> py::object {
    const auto acc = accelerator();
    if (!acc.has_value()) {
      return py::none();
    }
    return py::cast(current_device(*acc));
  });
  m.def("_generation", &Runtime::current_generation);

  // ---- communication streams (comm.h) ----
  py::class_<CollectiveGuard>(m, "_CollectiveGuard")
      .def(py::init<>());
  m.def("_comm_stream", [](py::handle worker_thread, py::handle device) {
    const int worker = worker_thread.is_none() ? collective_worker() : to_worker_id(worker_thread);
    return comm_stream(worker, to_device(device));
  }, py::arg("worker_thread"), py::arg("device"));
  m.def("_collective_worker", &collective_worker);
  m.def("_set_collective_debug", &set_collective_debug, py::arg("on"));
  m.def("_collective_debug", &collective_debug);
  m.def("_collective_hazards", &collective_hazards);
  m.def("_clear_collective_hazards", &clear_collective_hazards);

  // ---- automatic synchronization (tracking) ----
  tracking::set_blocking_wait([](const tracking::Step& step) {
    // The task being waited for needs the GIL: never hold it while waiting.
    const bool holds_gil = !python::python_exiting() && Py_IsInitialized() && PyGILState_Check();
    if (holds_gil) {
      py::gil_scoped_release no_gil;
      while (!step(python::kPollInterval)) {
      }
    } else {
      while (!step(python::kPollInterval)) {
      }
    }
  });
  py::class_<tracking::TrackScope>(m, "_TrackScope")
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&>(),
           py::arg("reads"), py::arg("writes"), py::call_guard<py::gil_scoped_release>());
  m.def("_set_tracking_enabled", &tracking::set_enabled, py::arg("enabled"),
        py::call_guard<py::gil_scoped_release>(),
        "Test switch: False stops automatic synchronization (tests use it to show the races it "
        "removes). Not for production code.");
  m.def("_tracking_enabled", &tracking::enabled);
  m.def("_work_waited", [](py::handle work) {
    // After Work.wait() / synchronize() / block_current_stream() (hooked by torch_pipeline).
    if (!tracking::live()) {
      return;
    }
    const py::object boxed = work.attr("boxed")();  // the Work as a torchbind object
    const c10::IValue v(py::cast<torch::jit::Object>(boxed)._ivalue());
    const void* target = torchbind_target(v);
    py::gil_scoped_release no_gil;
    tracking::work_waited(target);
  }, py::arg("work"));
  m.def("_set_allocator_safety", [](const std::string& mode) {
    TORCH_CHECK_VALUE(mode == "keep_alive" || mode == "record_stream",
                      "allocator safety must be 'keep_alive' or 'record_stream', got '", mode, "'");
    tracking::set_allocator_safety(mode == "keep_alive" ? tracking::AllocatorSafety::kKeepAlive
                                                  : tracking::AllocatorSafety::kRecordStream);
  }, py::arg("mode"), "Chooses how memory used off its allocation stream is kept from reuse "
     "(bench/bench_allocator.py compares the two).");
  m.def("_allocator_safety", [] {
    return tracking::allocator_safety() == tracking::AllocatorSafety::kKeepAlive ? "keep_alive"
                                                                             : "record_stream";
  });
  m.def("_tracking_stats", [] {
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
    d["storages"] = s.storages;
    d["streams"] = s.streams;
    return d;
  }, "Counters of automatic synchronization (for tests and monitoring).");
  m.def("_cuda_exclusive_streams", [] { return has_exclusive_streams(c10::kCUDA); });
  python::init_sim_bindings(m);
}
