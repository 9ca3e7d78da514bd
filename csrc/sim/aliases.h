// CPU aliases of sim memory, shared by the boxed fallback (fallback.cpp) and the copy kernels
// (copy.cpp): a CPU tensor over the same host memory as a sim tensor, with the same sizes, strides
// and offset, so that CPU kernels compute on sim tensors; and the way back, from CPU results to
// sim tensors.
#pragma once

#include "race_checker.h"

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/Storage.h>

#include <cstddef>
#include <deque>
#include <vector>

namespace torch_pipeline {
namespace sim {

inline constexpr c10::DispatchKeySet kSimKeys{c10::DispatchKey::PrivateUse1};

// A defined tensor on a sim device.
bool is_sim(const at::Tensor& t);

// The bytes of sim tensor `t` as access ranges, described as its storage (ops.h).
void add_accesses(const at::Tensor& t, bool write, std::vector<Access>& out);
std::vector<Access> accesses_of(const at::Tensor& t, bool write);

// The CPU aliases of one call: aliases of one sim storage share one CPU storage, so the CPU
// kernels see overlap as they would on the CPU. The sim storages stay alive while the map does.
class AliasMap {
 public:
  struct Entry {
    c10::Storage sim;  // keeps the sim memory alive during the call
    c10::Storage cpu;
    void* data;
    size_t nbytes;
  };

  at::Tensor alias(const at::Tensor& t);
  Entry* by_cpu(const c10::StorageImpl* cpu);
  Entry* by_sim(const c10::StorageImpl* sim);

 private:
  Entry& entry_for(const c10::Storage& sim);

  std::deque<Entry> entries_;  // pointers stay valid
};

// A CPU tensor over the memory of CPU tensor `t` (same sizes, strides, offset and math bits) with
// no autograd metadata and a version counter of its own: what a queued kernel may hold of a host
// tensor of the program, which it must not touch (its grad_fn, its version) from the stream's
// thread.
at::Tensor host_alias(const at::Tensor& t);

// A new sim tensor on the current device holding the values of CPU tensor `c`.
at::Tensor to_new_sim_tensor(const at::Tensor& c);

// A sim tensor viewing `sim` storage as CPU alias view `c` views its alias.
at::Tensor sim_view(const at::Tensor& c, const c10::Storage& sim);

}  // namespace sim
}  // namespace torch_pipeline
