// Per-operator facts, read once from the operator's schema and cached (docs/design.md,
// "The tracker's modules": "cache per-operator schema facts"). The one source of what an op touches
// for both the tracker (which looks ops up from a RecordFunction) and the sim device's kernels and
// race checker (which look them up from an OperatorHandle or an OperatorName): every lookup of one
// operator returns the same OpFacts object, so the two never disagree about whether an op touches
// memory. NB: the object lives for the rest of the process (a reference to it may be kept).
#pragma once

#include <ATen/core/alias_info.h>
#include <ATen/core/operator_name.h>
#include <ATen/record_function.h>

#include <cstdint>
#include <string>
#include <vector>

namespace c10 {
class OperatorHandle;
}  // namespace c10

namespace torch_pipeline {

struct OpFacts {
  std::string name;            // schema name, "aten::add"
  std::string overload;        // "Tensor" ("" for the default overload)
  std::string full_name;       // "aten::add.Tensor" (the op as race reports name it)
  std::vector<uint8_t> write;  // per argument: the schema marks it written (in-place, out=); for
                               // c10d collectives (unannotated) their outputs or, in place, tensors
  // A `write` of kWrittenIf is written only when the bool argument `written_if` is true: batch
  // norm's running statistics, which operators whose schemas do not mark them update in place
  // when training (Note [Writes a schema hides], op_facts.cpp). Read it with writes_argument().
  static constexpr uint8_t kWrittenIf = 2;
  int written_if = -1;  // index of that bool argument, or -1
  // Views and metadata queries (and the ops listed in op_facts.cpp that touch no data): no data
  // access of their own. The tracker looks through them to the ops they call (x.to(dtype) is
  // aten::to, a view op, around aten::_to_copy); the sim device records nothing for them.
  bool transparent = false;
  int non_blocking = -1;  // index of a bool argument named non_blocking, or -1
  // Per return: the schema says it aliases an argument (Tensor(a), Tensor(a!)): it is that
  // argument, never a fresh output, even when it comes back with another storage than it went in
  // with (set_ from a Storage, which no tensor input shows).
  std::vector<uint8_t> aliased_return;
  // The op may give a written argument new memory: resize_, resize_as_, and out= ops (they resize
  // an out argument of the wrong size). Its old block is freed inside the op (allocator safety of
  // the old block, docs/design.md, "The rules").
  bool may_move = false;
  // The host waits for the result, like CUDA's .item() or nonzero: an op returning host values
  // (not tensors, not torchbind objects such as a c10d Work), or one listed in op_facts.cpp whose
  // output size depends on the data. Never set for transparent ops. Used by the sim device.
  bool syncs_host = false;
  bool known = false;  // false: no schema (not a dispatcher op); treated as transparent
  bool c10d = false;   // a c10d op (namespace c10d::): a collective, which may return a Work
};

// Whether argument `i` of a call with these arguments is written (a kWrittenIf write by its bool;
// read conservatively as written when the bool is missing).
inline bool writes_argument(const OpFacts& f, size_t i, c10::ArrayRef<c10::IValue> args) {
  if (i >= f.write.size() || f.write[i] == 0) {
    return false;
  }
  if (f.write[i] != OpFacts::kWrittenIf) {
    return true;
  }
  const auto c = static_cast<size_t>(f.written_if);
  return c >= args.size() || !args[c].isBool() || args[c].toBool();
}

// Whether an argument with this alias annotation is written by the op (Tensor(a!), or a list of
// such). Shared with the sim device's kernels.
bool alias_is_write(const c10::AliasInfo* ai);

// The object a torchbind value holds (a c10d Work, a ProcessGroup), which identifies it across
// calls (the IValue wrapping it is made anew each time); nullptr for other values.
const void* torchbind_target(const c10::IValue& v);

// The facts of the op `fn` stands for (the tracker's hot path). Thread-safe; a hit costs a
// thread-local hash lookup keyed by the name pointer.
const OpFacts& op_facts(const at::RecordFunction& fn);
// The facts of a dispatcher operator (the sim device's kernels). Thread-safe; a hit costs a
// thread-local hash lookup keyed by the operator's entry.
const OpFacts& op_facts(const c10::OperatorHandle& op);
// The facts of the operator named so, or facts with known == false (transparent, nothing
// written) when no such operator is registered.
const OpFacts& op_facts(const c10::OperatorName& name);

// The operator names (all overloads) that touch no data although their schema does not say so,
// and those whose kernels wait for the device (for tests; see op_facts.cpp for the reasons).
const std::vector<std::string>& no_data_ops();
const std::vector<std::string>& host_sync_ops();

}  // namespace torch_pipeline
