#include "op_facts.h"

#include "thread_local_ref.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/function_schema.h>

#include <pthread.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace torch_pipeline {
namespace {

// ---- the lists ----------------------------------------------------------------------------------
// Ops (every overload) that touch no data although their schema does not say so: they return
// host values (or, record_stream, mark an argument written) from the tensors' metadata alone.
// Without this list the tracker would order them after pending writers of their arguments and the
// sim device would record them as reads and as host synchronizations. Names are matched, never
// looked up, so the list holds on every torch version: each name is an operator of the dispatcher
// on some supported torch and TorchScript-only on the others (aten::numel, dim, storage_offset,
// is_contiguous on torch 2.11), where neither the tracker nor the sim ever sees it, just as
// JIT-only ops such as aten::is_non_overlapping_and_dense (tests/python/test_op_facts.py).
// (Leaked, as the cache is: ops may run on other threads while the process exits.)
const std::vector<std::string>* g_no_data_ops = new std::vector<std::string>{
    // Shape and layout queries: sizes, strides and offset live in the TensorImpl.
    "aten::size",
    "aten::sym_size",
    "aten::stride",
    "aten::sym_stride",
    "aten::numel",
    "aten::sym_numel",
    "aten::dim",
    "aten::storage_offset",
    "aten::sym_storage_offset",
    "aten::is_contiguous",
    // dtype queries.
    "aten::is_complex",
    "aten::is_floating_point",
    "aten::is_signed",
    // Flags of the tensor (math bits, the zero-tensor dispatch key), not of its values.
    "aten::is_conj",
    "aten::is_neg",
    "aten::_is_zerotensor",
    // Autograd metadata.
    "aten::is_inference",
    "aten::is_leaf",
    "aten::output_nr",
    "aten::_version",
    // Compare two tensors' metadata (sizes; TensorImpl types; storage and geometry), not bytes.
    "aten::is_same_size",
    "aten::_has_compatible_shallow_copy_type",
    "aten::is_set_to",
    "aten::_has_same_storage_numel",  // (autograd checks it on tensors of torch.func levels)
    // Forward-mode AD plumbing: splits a dual tensor into its primal (a view) and tangent.
    "aten::_unpack_dual",
    // Sparse tensors' metadata.
    "aten::_nnz",
    "aten::sparse_dim",
    "aten::dense_dim",
    "aten::is_coalesced",
    // Asks the allocator about the data pointer.
    "aten::is_pinned",
    // Schema: Tensor(a!) self; it tells the allocator that the storage is used on a stream.
    "aten::record_stream",
};

// Ops whose CUDA kernels wait for the device although they return tensors: their output size
// depends on the data (equal returns a bool, which marks it anyway; listed for the reader).
const std::vector<std::string>* g_host_sync_ops =
    new std::vector<std::string>{"aten::nonzero",
                                 "aten::masked_select",
                                 "aten::_unique",
                                 "aten::_unique2",
                                 "aten::unique_dim",
                                 "aten::unique_consecutive",
                                 "aten::unique_dim_consecutive",
                                 "aten::repeat_interleave",
                                 "aten::equal"};

// Note [Writes a schema hides]: these operators write the named arguments in place although their
// schemas do not mark them (a tensor without (a!)): batch norm's running statistics, updated
// when `training` (instance norm: `use_input_stats`) is true, or always (the SyncBatchNorm
// kernels and batch_norm_update_stats). Read as reads, a later reader on another stream would
// not wait for the update (the tracker) and the race would go unseen (the sim's checker). Every
// overload whose schema has the named arguments; the others (_native_batch_norm_legit,
// _batch_norm_with_update) declare theirs. tests/python/test_op_facts.py fails on an operator
// of the installed torch with an unmarked running_mean that is neither listed nor, by its name, a
// reader (backward, _no_training, _no_update, _functional).
struct HiddenWrite {
  const char* op;
  const char* when;  // the bool argument that turns the write on, nullptr: always
};
const std::vector<HiddenWrite>* g_hidden_writes = new std::vector<HiddenWrite>{
    {"aten::batch_norm", "training"},
    {"aten::_batch_norm_impl_index", "training"},
    {"aten::native_batch_norm", "training"},
    {"aten::cudnn_batch_norm", "training"},
    {"aten::miopen_batch_norm", "training"},
    {"aten::instance_norm", "use_input_stats"},
    {"aten::batch_norm_update_stats", nullptr},
    {"aten::batch_norm_gather_stats", nullptr},
    {"aten::batch_norm_gather_stats_with_counts", nullptr},
};

bool listed(const std::vector<std::string>& list, const std::string& name) {
  return std::find(list.begin(), list.end(), name) != list.end();
}

// ---- facts from a schema ------------------------------------------------------------------------
bool tensor_like(const c10::TypePtr& type) {
  switch (type->kind()) {
    case c10::TypeKind::TensorType:
      return true;
    case c10::TypeKind::ListType:
      return tensor_like(type->castRaw<c10::ListType>()->getElementType());
    case c10::TypeKind::OptionalType:
      return tensor_like(type->castRaw<c10::OptionalType>()->getElementType());
    default:
      return false;
  }
}

// c10d schemas carry no alias annotations, but collectives write their outputs ("output",
// "outputs", "output_tensors", ...), or, for in-place ones without outputs (allreduce_,
// broadcast_, recv_, ...), their "tensors". Returns whether any argument is written now.
bool infer_c10d_writes(const c10::FunctionSchema& s, OpFacts& f) {
  const auto& args = s.arguments();
  bool any_write = false;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name().compare(0, 6, "output") == 0) {
      f.write[i] = 1;
      any_write = true;
    }
  }
  if (!any_write && !f.name.empty() && f.name.back() == '_') {
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].name() == "tensors") {
        f.write[i] = 1;
        any_write = true;
      }
    }
  }
  return any_write;
}

// Marks the running statistics of an operator in g_hidden_writes written (kWrittenIf, by the
// bool argument `when`, if not null). Returns whether it marked any.
bool add_hidden_writes(const c10::FunctionSchema& s, const char* when, OpFacts& f) {
  const auto& args = s.arguments();
  int condition = -1;
  if (when != nullptr) {
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].name() == when && args[i].type()->kind() == c10::TypeKind::BoolType) {
        condition = static_cast<int>(i);
      }
    }
    if (condition < 0) {
      return false;  // (not this overload's shape: leave its schema as it is)
    }
  }
  bool marked = false;
  for (size_t i = 0; i < args.size(); ++i) {
    if ((args[i].name() == "running_mean" || args[i].name() == "running_var") && f.write[i] == 0) {
      f.write[i] = condition < 0 ? 1 : OpFacts::kWrittenIf;
      marked = true;
    }
  }
  if (marked && condition >= 0) {
    f.written_if = condition;
  }
  return marked;
}

OpFacts compute(const c10::FunctionSchema& s) {
  OpFacts f;
  f.known = true;
  f.name = s.name();
  f.overload = s.overload_name();
  f.full_name = f.overload.empty() ? f.name : f.name + "." + f.overload;
  bool any_write = false;
  const auto& args = s.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const bool w = alias_is_write(args[i].alias_info());
    f.write.push_back(w ? 1 : 0);
    any_write |= w;
    if (args[i].name() == "non_blocking" && args[i].type()->kind() == c10::TypeKind::BoolType) {
      f.non_blocking = static_cast<int>(i);
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    // An out argument (kwarg-only and written: out=, values=, indices=, eigvals=, ...; or named
    // out*) is resized when its size is wrong.
    if (f.write[i] != 0 && (args[i].is_out() || args[i].name().compare(0, 3, "out") == 0)) {
      f.may_move = true;
    }
  }
  f.may_move |= f.name == "aten::resize_" || f.name == "aten::resize_as_" ||
                f.name == "aten::_resize_output_";
  if (f.name == "inductor::resize_storage_bytes_" && !f.write.empty()) {
    // UntypedStorage.resize_ as Dynamo traces it (compiled FSDP2): its schema declares no write,
    // yet it frees or reallocates the tensor's storage.
    f.write[0] = 1;
    any_write = true;
    f.may_move = true;
  }
  for (const HiddenWrite& h : *g_hidden_writes) {
    if (f.name == h.op) {
      any_write |= add_hidden_writes(s, h.when, f);
    }
  }
  f.c10d = f.name.compare(0, 6, "c10d::") == 0;
  if (f.c10d && !any_write) {
    any_write = infer_c10d_writes(s, f);
  }
  bool all_views = !s.returns().empty();
  bool host_values = !s.returns().empty();  // every return is a host value
  for (const auto& ret : s.returns()) {
    const auto* ai = ret.alias_info();
    f.aliased_return.push_back(ai != nullptr ? 1 : 0);
    if (ai == nullptr || alias_is_write(ai)) {
      all_views = false;
    }
    if (tensor_like(ret.type()) || ret.type()->kind() == c10::TypeKind::ClassType) {
      host_values = false;  // a tensor, or a handle such as a c10d Work
    }
  }
  f.transparent = (all_views && !any_write) || listed(*g_no_data_ops, f.name);
  f.syncs_host = !f.transparent && (host_values || listed(*g_host_sync_ops, f.name));
  return f;
}

const OpFacts& unknown_facts() {
  static const OpFacts* unknown = [] {
    auto* f = new OpFacts();
    f->transparent = true;
    return f;
  }();
  return *unknown;
}

// ---- the one cache ------------------------------------------------------------------------------
// Keyed by operator name; entries are never freed, so the thread-local caches may point at them.
// The lock is a leaf: nothing else is taken while it is held (schemas are read outside it).
std::mutex g_mutex;
auto* g_facts = new std::unordered_map<c10::OperatorName, std::unique_ptr<OpFacts>>();

// fork() while another thread holds g_mutex would leave it locked in the child forever: the
// forking thread takes it around fork, so the map is consistent and the lock free on both sides.
struct ForkHandlers {
  ForkHandlers() {
    pthread_atfork([] { g_mutex.lock(); }, [] { g_mutex.unlock(); }, [] { g_mutex.unlock(); });
  }
} fork_handlers;

const OpFacts* find(const c10::OperatorName& name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_facts->find(name);
  return it != g_facts->end() ? it->second.get() : nullptr;
}

// The cached facts of `name`, computed from `schema` unless another thread was first.
const OpFacts& insert(const c10::OperatorName& name, const c10::FunctionSchema& schema) {
  auto facts = std::make_unique<OpFacts>(compute(schema));
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& slot = (*g_facts)[name];
  if (!slot) {
    slot = std::move(facts);
  }
  return *slot;
}

bool same_op(const OpFacts& f, const at::RecordFunction& fn) {
  return std::strcmp(f.name.c_str(), fn.name()) == 0 &&
         std::strcmp(f.overload.c_str(), fn.overload_name()) == 0;
}

const OpFacts& lookup_slow(const at::RecordFunction& fn) {
  // Not cached when schema-less: the name of such a RecordFunction is its own string.
  const std::optional<c10::OperatorName> name = fn.operator_name();
  if (!name.has_value()) {
    return unknown_facts();
  }
  if (const OpFacts* f = find(*name)) {
    return *f;
  }
  const std::optional<c10::FunctionSchema> schema = fn.operator_schema();
  if (!schema.has_value()) {
    return unknown_facts();
  }
  return insert(*name, *schema);
}

}  // namespace

bool alias_is_write(const c10::AliasInfo* ai) {
  if (ai == nullptr) {
    return false;
  }
  if (ai->isWrite()) {
    return true;
  }
  for (const auto& c : ai->containedTypes()) {
    if (c.isWrite()) {
      return true;
    }
  }
  return false;
}

const void* torchbind_target(const c10::IValue& v) {
  if (!v.isObject()) {
    return nullptr;
  }
  const auto& obj = v.toObjectRef();
  if (obj.slots().size() == 1 && obj.getSlot(0).isCapsule()) {
    return obj.getSlot(0).toCapsule().get();
  }
  return nullptr;
}

const OpFacts& op_facts(const at::RecordFunction& fn) {
  thread_local std::unordered_map<const char*, const OpFacts*> cache;
  const char* key = fn.name();
  auto it = cache.find(key);
  if (it != cache.end() && same_op(*it->second, fn)) {
    return *it->second;
  }
  const OpFacts& f = lookup_slow(fn);
  if (f.known) {
    cache[key] = &f;
  }
  return f;
}

const OpFacts& op_facts(const c10::OperatorHandle& op) {
  // Keyed by the operator's name in its registration (stable while it is registered); checked
  // against the facts' names in case another operator took its place.
  thread_local std::unordered_map<const c10::OperatorName*, const OpFacts*> cache_of_thread;
  auto& cache = thread_local_ref(cache_of_thread);
  const c10::OperatorName& name = op.operator_name();
  auto it = cache.find(&name);
  if (it != cache.end() && it->second->name == name.name &&
      it->second->overload == name.overload_name) {
    return *it->second;
  }
  const OpFacts* f = find(name);
  if (f == nullptr) {
    f = &insert(name, op.schema());
  }
  cache[&name] = f;
  return *f;
}

const OpFacts& op_facts(const c10::OperatorName& name) {
  if (const OpFacts* f = find(name)) {
    return *f;
  }
  // Outside our lock: the dispatcher takes its own.
  if (const std::optional<c10::OperatorHandle> op = c10::Dispatcher::singleton().findSchema(name)) {
    return op_facts(*op);
  }
  return unknown_facts();  // not cached: the operator may be registered later
}

const std::vector<std::string>& no_data_ops() { return *g_no_data_ops; }

const std::vector<std::string>& host_sync_ops() { return *g_host_sync_ops; }

}  // namespace torch_pipeline
