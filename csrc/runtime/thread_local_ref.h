// A thread-local's address, computed once per function (see Note [Thread-locals in the hot path]).
#pragma once

namespace torch_pipeline {

// Note [Thread-locals in the hot path]: in a shared library a thread-local's address comes from
// a call to __tls_get_addr (the general-dynamic model; the module's thread-locals are too large
// for the static surplus a dlopen'ed library may use), and GCC rematerialises that call at each
// use instead of keeping the address in a register: op_start made about 28 such calls per op and
// op_end 20 (callgrind, a sim torch.add). `thread_local_ref(x)` hides where the reference came
// from, so the address is computed once and kept like any other pointer. Use it where a function
// touches a thread-local more than once.
template <class T>
inline T& thread_local_ref(T& x) {
  T* p = &x;
  asm("" : "+r"(p));  // (an opaque copy: the compiler cannot recompute it from &x)
  return *p;
}

}  // namespace torch_pipeline
