// Per-operator facts the op observer needs, read once from the operator's schema and cached
// (DESIGN.md §4: "cache per-operator schema facts").
#pragma once

#include <ATen/core/alias_info.h>
#include <ATen/record_function.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch_pipeline {

struct OpFacts {
  std::string name;            // schema name, "aten::add"
  std::string overload;        // "Tensor"
  std::vector<uint8_t> write;  // per argument: the schema marks it written (in-place, out=); for
                               // c10d collectives (unannotated) their outputs or, in place, tensors
  // Views and metadata queries: no data access of their own. The observer looks through them to
  // the ops they call (x.to(dtype) is aten::to, a view op, around aten::_to_copy).
  bool transparent = false;
  int non_blocking = -1;  // index of a bool argument named non_blocking, or -1
  bool known = false;     // false: no schema (not a dispatcher op); treated as transparent
};

// Whether an argument with this alias annotation is written by the op (Tensor(a!), or a list of
// such). Shared with the sim device's kernels.
bool alias_is_write(const c10::AliasInfo* ai);

// The object a torchbind value holds (a c10d Work, a ProcessGroup), which identifies it across
// calls (the IValue wrapping it is made anew each time); nullptr for other values.
const void* torchbind_target(const c10::IValue& v);

// The facts of the op `fn` stands for. Thread-safe; a hit costs a thread-local hash lookup.
const OpFacts& op_facts(const at::RecordFunction& fn);

}  // namespace torch_pipeline
