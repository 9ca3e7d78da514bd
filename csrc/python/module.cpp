// torch_pipeline._C: the Python bindings. Only argument checking and conversion live in
// csrc/python (convert.h); the behaviour is in csrc/runtime. This file makes the module: the
// exception translation, the hooks the runtime calls back through, and the bindings of each area.
#include "bindings.h"
#include "gil.h"
#include "sim_bindings.h"

#include "../runtime/host_waits.h"
#include "../runtime/runtime.h"
#include "../runtime/tracking.h"

#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
using namespace torch_pipeline;

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

  // Worker threads let go of the GIL when idle; every blocking wait (runtime and tracker) lets go
  // of it while blocked; the runtime's waits can be interrupted with Ctrl-C, the tracker's (inside
  // an op) cannot.
  Runtime::set_idle_hook(&python::worker_release_gil);
  python::install_terminate_handler();
  set_block_hook(&python::wait_releasing_gil);
  tracking::set_blocking_wait([](const tracking::Step& step) {
    python::wait_releasing_gil(step, /*interruptible=*/false);
  });

  python::bind_pipelines(m);
  python::bind_runtime(m);
  python::bind_capture(m);
  python::init_sim_bindings(m);
}
