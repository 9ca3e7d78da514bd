// What an op touches in bytes, shared by the sim kernels and the host-side check of pinned memory
// (host.cpp): the byte ranges of a tensor. What an op reads and writes, per argument, is in the
// runtime's per-operator facts (csrc/runtime/op_facts.h), which the tracker uses too.
#pragma once

#include "race_checker.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace sim {

// A strided tensor is recorded as at most this many ranges (one per contiguous run of its bytes);
// beyond it, its innermost non-contiguous dims are covered by their bounding ranges.
constexpr int64_t kMaxRuns = int64_t{1} << 16;

// The bytes of `t` as access ranges, appended to `out`, each described as `memory`: exact for
// dense tensors and for strided views of up to kMaxRuns contiguous runs (so disjoint slices of one
// storage do not conflict), coarser beyond; a nested tensor's is its whole buffer (its storage).
// Nothing for undefined, storage-less or empty tensors.
void add_accesses(const at::Tensor& t, bool write, const std::string& memory,
                  std::vector<Access>& out);

// Sets the conjugate and negative bits of `to` where `from` has them.
void copy_math_bits(const at::Tensor& from, c10::TensorImpl* to);

}  // namespace sim
}  // namespace torch_pipeline
