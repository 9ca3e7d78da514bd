// What an op touches, shared by the sim kernels (kernels.cpp) and the host-side check of pinned
// memory (host.cpp): per-operator facts read from the schema, and the byte ranges of a tensor.
#pragma once

#include "race_checker.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace sim {

struct OpFacts {
  std::string name;            // "aten::add.Tensor"
  std::vector<char> write;     // per argument: the schema marks it written
  bool metadata_only = false;  // views and queries: no data access
  bool syncs_host = false;     // the host waits for the result (like CUDA's .item(), nonzero)
};

// The facts of an operator (computed once, cached; thread-safe). The name overload finds the
// schema; an operator without one gets facts with no written argument.
const OpFacts& op_facts(const c10::OperatorHandle& op);
const OpFacts& op_facts(const c10::OperatorName& name);

// A strided tensor is recorded as at most this many ranges (one per contiguous run of its bytes);
// beyond it, its innermost non-contiguous dims are covered by their bounding ranges.
constexpr int64_t kMaxRuns = int64_t{1} << 16;

// The bytes of `t` as access ranges, appended to `out`, each described as `memory`: exact for
// dense tensors and for strided views of up to kMaxRuns contiguous runs (so disjoint slices of one
// storage do not conflict), coarser beyond. Nothing for undefined, storage-less or empty tensors.
void add_accesses(const at::Tensor& t, bool write, const std::string& memory,
                  std::vector<Access>& out);

// Sets the conjugate and negative bits of `to` where `from` has them.
void copy_math_bits(const at::Tensor& from, c10::TensorImpl* to);

}  // namespace sim
}  // namespace torch_pipeline
