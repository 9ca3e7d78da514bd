// Bindings of worker threads and pipelines: argument checking and conversion only; the behaviour
// is in csrc/runtime (context.h, host_waits.h) and tasks.h.
#include "bindings.h"
#include "convert.h"
#include "gil.h"
#include "tasks.h"

#include "../runtime/context.h"
#include "../runtime/event.h"
#include "../runtime/host_waits.h"
#include "../runtime/runtime.h"

#include <torch/version.h>

#include <sstream>

namespace py = pybind11;

namespace torch_pipeline {
namespace python {
namespace {

// What tp.pipeline(None) returns, like torch.cuda.stream(None): a no-op.
struct NoPipeline {};
py::object* g_no_pipeline = nullptr;  // the NoPipeline instance, leaked

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

using Warnings = py::call_guard<PythonWarnings>;

// TypeError for arguments Pipeline(worker_thread=None, *, priority=0) does not take.
[[noreturn]] void bad_pipeline_arguments(const py::args& args, const py::kwargs& kwargs) {
  constexpr const char* kSignature = "Pipeline(worker_thread=None, *, priority=0)";
  TORCH_CHECK_TYPE(args.size() <= 1, kSignature,
                   " takes at most one positional argument (the worker thread), "
                   "got ",
                   args.size(), "; pass priority by keyword, e.g. Pipeline(1, priority=0)");
  for (const auto& item : kwargs) {
    const std::string key = py::str(item.first);
    TORCH_CHECK_TYPE(key == "worker_thread" || key == "priority", kSignature,
                     " got an unexpected keyword argument '", key, "'");
  }
  TORCH_CHECK_TYPE(false, kSignature, " got worker_thread twice (by position and by keyword)");
}

// How this extension was built: what `python -m torch_pipeline` prints.
py::dict build_info() {
  py::dict d;
#ifdef TORCH_PIPELINE_WITH_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
  d["torch"] = TORCH_VERSION;  // the torch headers it was compiled against
#if defined(__clang__)
  d["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  d["compiler"] = std::string("gcc ") + __VERSION__;
#else
  d["compiler"] = "unknown";
#endif
  d["cplusplus"] = static_cast<long>(__cplusplus);
#ifdef _GLIBCXX_USE_CXX11_ABI
  d["cxx11_abi"] = static_cast<bool>(_GLIBCXX_USE_CXX11_ABI);
#endif
  return d;
}

}  // namespace

void bind_pipelines(py::module_& m) {
  // ---- worker threads ----------------------------------------------------------------------
  py::class_<WorkerThreadHandle>(m, "WorkerThread", R"doc(
A long-lived worker thread of torch_pipeline's capped pool. Get one with get_worker_thread(i).

    >>> t = torch_pipeline.get_worker_thread(1)
    >>> p = torch_pipeline.Pipeline(t)
)doc")
      .def(py::init([](py::args, py::kwargs) -> WorkerThreadHandle {
        TORCH_CHECK_TYPE(false,
                         "WorkerThread objects are not created directly: use "
                         "torch_pipeline.get_worker_thread(i)");
        return {};
      }))
      .def_property_readonly("id", [](const WorkerThreadHandle& t) { return t.id; })
      .def("__eq__",
           [](const WorkerThreadHandle& a, py::handle b) {
             return py::isinstance<WorkerThreadHandle>(b) &&
                    py::cast<WorkerThreadHandle&>(b).id == a.id;
           })
      .def("__hash__", [](const WorkerThreadHandle& t) { return py::hash(py::int_(t.id)); })
      .def("__repr__", [](const WorkerThreadHandle& t) {
        return "<torch_pipeline.WorkerThread id=" + std::to_string(t.id) + ">";
      });

  m.def(
      "get_worker_thread",
      [](py::handle id) {
        TORCH_CHECK_TYPE(is_int(id), "get_worker_thread expects an int id, got an object of type ",
                         type_name(id));
        const int i = to_worker_id(id);
        Runtime::get().check_worker_id(i);
        return WorkerThreadHandle{i};
      },
      py::arg("id"), "The handle of worker thread `id` (0 <= id < max_worker_threads()).");
  m.def("max_worker_threads", &max_worker_threads, "The worker-thread cap (default 4).");
  m.def("_build_info", &build_info, "How this extension was built (python -m torch_pipeline).");
  m.def(
      "set_max_worker_threads",
      [](py::handle n) {
        TORCH_CHECK_TYPE(is_int(n), "set_max_worker_threads expects an int, got an object of type ",
                         type_name(n));
        const auto v = int_in_range(n, 1, kMaxWorkerThreadsLimit);
        TORCH_CHECK_VALUE(v.has_value(), "max worker threads must be in [1, ",
                          kMaxWorkerThreadsLimit, "], got ", py::str(n).cast<std::string>());
        set_max_worker_threads(static_cast<int>(*v));
      },
      py::arg("n"),
      "Sets the worker-thread cap; only before the first Pipeline, get_worker_thread "
      "or submit.");

  // ---- pipelines -----------------------------------------------------------------------------
  py::class_<PipelineImpl, PipelinePtr>(m, "Pipeline", R"doc(
A cross-device lane of streams bound to a worker thread (like torch.cuda.Stream, on every device).

``Pipeline(worker_thread=None, *, priority=0)``: worker_thread is a WorkerThread, its id, or None
(worker thread 0); priority as for torch.cuda.Stream (lower is higher). ``id`` is the pipeline's
slot among the live pipelines of its (worker thread, priority): lifetime-disjoint pipelines reuse
the smallest free slot and its streams. In a process forked from the one that created it, every
method raises RuntimeError (its worker thread and streams do not exist there).

    >>> p = torch_pipeline.Pipeline()
    >>> with p:                      # p's streams are the current torch streams here
    ...     y = model(x)
    >>> fut = p.submit(torch.add, a, b)   # runs on p's worker thread, under p
    >>> c = fut.wait()
)doc")
      .def(py::init([](py::handle worker_thread, py::handle priority) {
             TORCH_CHECK_TYPE(is_int(priority), "priority must be an int, got an object of type ",
                              type_name(priority));
             const auto pr = int_in_range(priority, -1024, 1024);
             TORCH_CHECK_VALUE(
                 pr.has_value(),
                 "priority must be in [-1024, 1024] (lower is higher "
                 "priority, as for torch.cuda.Stream; backends clamp it to their range), got ",
                 py::str(priority).cast<std::string>());
             PipelinePtr p =
                 Runtime::get().create_pipeline(to_worker_id(worker_thread), static_cast<int>(*pr));
             note_distributed_use();
             note_pipeline_created();
             return p;
           }),
           py::arg("worker_thread") = py::none(), py::kw_only(), py::arg("priority") = 0,
           Warnings())
      // Any other arguments: say what the constructor takes (pybind would list its overloads).
      .def(py::init([](py::args args, py::kwargs kwargs) -> PipelinePtr {
        bad_pipeline_arguments(args, kwargs);
        return nullptr;  // not reached
      }))
      .def_property_readonly("id", &PipelineImpl::id)
      .def_property_readonly(
          "worker_thread", [](const PipelineImpl& p) { return WorkerThreadHandle{p.worker_id()}; })
      .def_property_readonly("priority", &PipelineImpl::priority)
      .def_property_readonly("is_default", &PipelineImpl::is_default)
      .def(
          "stream",
          [](PipelineImpl& p, py::handle device) -> py::object {
            p.check_usable();
            const auto d = to_accelerator_device(device);
            if (!d.has_value()) {
              return py::none();
            }
            return to_python_stream(pipeline_stream(p, *d));
          },
          py::arg("device") = py::none(), Warnings(), R"doc(
This pipeline's stream on ``device`` (a torch.device, str, int index, or None for the current
accelerator device).

Returns None for the CPU, or when no accelerator is available. The stream is acquired on first
use; for the default pipeline it is the stream that was current outside any pipeline context on
this thread. On CUDA the result is a ``torch.cuda.Stream``.

    >>> p = torch_pipeline.Pipeline()
    >>> s = p.stream("cuda:0")          # doctest: +SKIP
    >>> with torch.cuda.stream(s): ...  # the same stream that `with p:` makes current
)doc")
      .def("_streams",
           [](PipelineImpl& p) {
             py::list out;
             for (const auto& ds : existing_streams(p)) {
               out.append(to_python_stream(ds.second));
             }
             return out;
           })
      .def("query", &query_pipeline,
           "Whether every task submitted to this pipeline has run and its streams are idle.")
      .def("synchronize", &synchronize_pipeline, Warnings(),
           "Waits for the tasks submitted to this pipeline, then for its streams (Ctrl-C "
           "interrupts the wait).")
      .def(
          "record_event",
          [](PipelinePtr p, py::object event) {
            p->check_usable();
            if (event.is_none()) {
              event = py::cast(std::make_shared<PipelineEvent>(false));
            }
            TORCH_CHECK_TYPE(py::isinstance<PipelineEvent>(event),
                             "record_event expects a "
                             "torch_pipeline.PipelineEvent or None, got an object of type ",
                             type_name(event));
            py::cast<PipelineEvent&>(event).record(*p);
            return event;
          },
          py::arg("event") = py::none(), Warnings(),
          "Records this pipeline's position on each of its devices (in `event`, or a new one).")
      .def(
          "wait_event",
          [](PipelinePtr p, py::handle event) {
            p->check_usable();
            TORCH_CHECK_TYPE(py::isinstance<PipelineEvent>(event),
                             "wait_event expects a "
                             "torch_pipeline.PipelineEvent, got an object of type ",
                             type_name(event));
            py::cast<PipelineEvent&>(event).wait(*p);
          },
          py::arg("event"), Warnings(), "Makes this pipeline's streams wait for `event`.")
      .def(
          "wait_pipeline",
          [](PipelinePtr p, py::handle other) {
            wait_pipeline(*p, *to_pipeline(other, "wait_pipeline"));
          },
          py::arg("other"), Warnings(),
          "Makes this pipeline's streams wait for the work queued on `other` so far.")
      // submit(fn, /, *args, **kwargs): fn is taken from *args so that a keyword named "fn"
      // reaches the task.
      .def(
          "submit",
          [](PipelinePtr p, py::args args, py::kwargs kwargs) {
            p->check_usable();
            TORCH_CHECK_TYPE(
                !args.empty(),
                "submit() missing the callable to run: submit(fn, /, *args, **kwargs)");
            py::object fn = args[0];
            py::tuple rest =
                py::reinterpret_steal<py::tuple>(PyTuple_GetSlice(args.ptr(), 1, args.size()));
            note_distributed_use();
            return submit(p, std::move(fn), std::move(rest), std::move(kwargs));
          },
          Warnings(),
          "Runs ``fn(*args, **kwargs)`` on this pipeline's worker thread, under this "
          "pipeline; returns a TaskFuture.")
      .def(
          "__enter__",
          [](py::object self) {
            enter_pipeline(py::cast<PipelinePtr>(self));
            return self;
          },
          Warnings())
      .def("__exit__",
           [](const PipelineImpl& p, py::handle, py::handle, py::handle) {
             exit_pipeline(&p);
             return false;
           })
      .def(
          "__call__",
          [](py::object self, py::handle fn) {
            py::cast<const PipelineImpl&>(self).check_usable();
            return decorate(self, fn);
          },
          "Decorator: `@p` (or `@torch_pipeline.pipeline(p)`) runs the function under p.")
      .def("__eq__",
           [](const PipelineImpl& a, py::handle b) {
             return py::isinstance<PipelineImpl>(b) && &py::cast<const PipelineImpl&>(b) == &a;
           })
      .def("__hash__", [](const PipelineImpl& p) { return std::hash<const void*>()(&p); })
      .def("__repr__", &pipeline_repr);

  // tp.pipeline(p) is p itself (a Pipeline is its own context manager and decorator), so that
  // `with tp.pipeline(p):` costs no more than `with p:`; tp.pipeline(None) is a shared no-op.
  py::class_<NoPipeline>(m, "_NoPipeline",
                         "What torch_pipeline.pipeline(None) returns: a no-op "
                         "context manager and decorator.")
      .def("__enter__", [](const NoPipeline&) { return py::none(); })
      .def("__exit__", [](const NoPipeline&, py::handle, py::handle, py::handle) { return false; })
      .def("__call__",
           [](const NoPipeline&, py::object fn) {
             TORCH_CHECK_TYPE(PyCallable_Check(fn.ptr()),
                              "a pipeline decorator needs a callable, got ", type_name(fn));
             return fn;
           })
      .def("__repr__", [](const NoPipeline&) { return "torch_pipeline.pipeline(None)"; });
  g_no_pipeline = new py::object(py::cast(NoPipeline{}));

  m.def(
      "pipeline",
      [](py::handle p) -> py::object {
        if (p.is_none()) {
          return *g_no_pipeline;
        }
        to_pipeline(p, "torch_pipeline.pipeline()")->check_usable();
        return py::reinterpret_borrow<py::object>(p);
      },
      py::arg("pipeline"), R"doc(
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
  m.def(
      "default_pipeline", [] { return Runtime::get().default_pipeline(); },
      "The default pipeline: the current torch streams outside any pipeline context, worker thread "
      "0.");
  m.def(
      "set_pipeline",
      [](py::handle p) {
        if (!p.is_none()) {
          set_pipeline(to_pipeline(p, "set_pipeline"));
        }
      },
      py::arg("pipeline"), Warnings(),
      "Makes `pipeline` current on this thread without a context "
      "to undo (like torch.cuda.set_stream); None changes nothing.");
  m.def("synchronize", &synchronize_all, Warnings(),
        "Waits for every task of every worker thread, then for every initialized accelerator "
        "device (Ctrl-C interrupts the wait).");
}

}  // namespace python
}  // namespace torch_pipeline
