// Python threads and the dispatcher path of automatic synchronization (tracking.h, Observer):
// each Python thread carries the observer's key from its next Python call after tracking goes
// live (Note [Observing Python threads]).
#include "threads.h"

#include "../runtime/tracking.h"

#include <Python.h>
#include <frameobject.h>

#if PY_VERSION_HEX >= 0x030D0000
// (3.13 moved its declaration to an internal header; the symbol is still exported)
extern "C" int _PyEval_SetProfile(PyThreadState* tstate, Py_tracefunc func, PyObject* arg);
#endif

namespace torch_pipeline {
namespace python {

namespace {

// Note [Observing Python threads]: a thread's dispatch key set is its own, so no thread can give
// another the observer's key. When tracking goes live, the thread that made it go live sweeps the
// other Python threads (GIL held): each gets a one-shot profile function, which the interpreter
// calls on that thread at its next call or return event (calling torch.add or a tensor method is
// one, so is returning from a blocking wait). It takes the key for its thread, puts back the
// profile function the thread had (a profiler's), and hands it the event. Threads started later
// take the key at their start (torch_pipeline/_threads.py). A thread that sits in the middle of
// a function running only operators (a + b) sees no such event until its next call; the backend
// check (tracking::device_op_seen) and the sampled check notice its device ops meanwhile.
constexpr const char* kSavedName = "torch_pipeline.saved_profile";

struct SavedProfile {
  Py_tracefunc func;
  PyObject* obj;  // owned
};

void drop_saved(PyObject* capsule) {
  auto* saved = static_cast<SavedProfile*>(PyCapsule_GetPointer(capsule, kSavedName));
  if (saved != nullptr) {
    Py_XDECREF(saved->obj);
    delete saved;
  }
}

int first_event(PyObject* capsule, PyFrameObject* frame, int what, PyObject* arg) {
  tracking::observe_this_thread();
  auto* saved = static_cast<SavedProfile*>(PyCapsule_GetPointer(capsule, kSavedName));
  if (saved == nullptr) {
    PyErr_Clear();
    _PyEval_SetProfile(PyThreadState_Get(), nullptr, nullptr);
    return 0;
  }
  const Py_tracefunc func = saved->func;
  PyObject* obj = saved->obj;
  Py_XINCREF(obj);
  // NB: this releases the capsule (perhaps its last reference): `saved` is not used after it.
  if (_PyEval_SetProfile(PyThreadState_Get(), func, obj) < 0) {
    PyErr_Clear();
  }
  const int result = func != nullptr ? func(obj, frame, what, arg) : 0;
  Py_XDECREF(obj);
  return result;
}

uint64_t g_swept = 0;  // the observed generation last swept (GIL)

}  // namespace

void observe_python_threads() {
  const uint64_t generation = tracking::observed_generation();
  if (generation == 0 || generation == g_swept) {
    return;
  }
  g_swept = generation;
  tracking::observe_this_thread();
  PyThreadState* self = PyThreadState_Get();
  // NB: with the GIL held no thread state is deleted; one added meanwhile (a thread starting
  // without the GIL) goes to the list's head, behind the walk, and takes the key at its start.
  for (PyThreadState* ts = PyInterpreterState_ThreadHead(self->interp); ts != nullptr;
       ts = PyThreadState_Next(ts)) {
    if (ts == self || ts->c_profilefunc == &first_event) {
      continue;
    }
    auto* saved = new SavedProfile{ts->c_profilefunc, ts->c_profileobj};
    Py_XINCREF(saved->obj);
    PyObject* capsule = PyCapsule_New(saved, kSavedName, &drop_saved);
    if (capsule == nullptr) {
      Py_XDECREF(saved->obj);
      delete saved;
      PyErr_Clear();
      continue;
    }
    if (_PyEval_SetProfile(ts, &first_event, capsule) < 0) {
      PyErr_Clear();
    }
    Py_DECREF(capsule);  // (the thread state holds it now)
  }
}

}  // namespace python
}  // namespace torch_pipeline
