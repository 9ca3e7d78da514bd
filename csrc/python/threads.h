// Python threads and the dispatcher path of automatic synchronization (threads.cpp).
#pragma once

namespace torch_pipeline {
namespace python {

// Once per live period of the dispatcher path, with the GIL held: this thread takes the
// observer's key now, every other Python thread at its next call (Note [Observing Python
// threads]). Cheap when there is nothing new to sweep.
void observe_python_threads();

}  // namespace python
}  // namespace torch_pipeline
