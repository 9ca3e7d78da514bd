#include "op_facts.h"

#include <ATen/core/function_schema.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace torch_pipeline {
namespace {

// Ops that touch no data although their schema does not say so.
const std::unordered_set<std::string>& metadata_ops() {
  static const auto* ops = new std::unordered_set<std::string>{
      "aten::is_set_to", "aten::_nnz", "aten::sparse_dim", "aten::dense_dim",
      "aten::is_coalesced", "aten::_is_zerotensor", "aten::is_pinned", "aten::record_stream",
      "aten::size", "aten::stride", "aten::numel", "aten::dim", "aten::is_same_size",
      "aten::_has_compatible_shallow_copy_type", "aten::is_nonzero_"};
  return *ops;
}

OpFacts compute(const c10::FunctionSchema& s) {
  OpFacts f;
  f.known = true;
  f.name = s.name();
  f.overload = s.overload_name();
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
  if (f.name.compare(0, 6, "c10d::") == 0 && !any_write) {
    // Collectives carry no alias annotations, but write their outputs ("output", "outputs",
    // "output_tensors", ...), or, for in-place ones without outputs (allreduce_, broadcast_,
    // recv_, ...), their "tensors".
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
  }
  bool all_views = !s.returns().empty();
  for (const auto& ret : s.returns()) {
    const auto* ai = ret.alias_info();
    if (ai == nullptr || alias_is_write(ai)) {
      all_views = false;
    }
  }
  f.transparent = (all_views && !any_write) || metadata_ops().count(f.name) > 0;
  return f;
}

std::mutex g_mutex;
// Keyed by the schema's name pointer (stable while the operator is registered); entries are
// never freed, so thread-local caches may point at them.
auto* g_facts = new std::unordered_multimap<const char*, std::unique_ptr<OpFacts>>();

bool same_op(const OpFacts& f, const at::RecordFunction& fn) {
  return std::strcmp(f.name.c_str(), fn.name()) == 0 &&
         std::strcmp(f.overload.c_str(), fn.overload_name()) == 0;
}

const OpFacts& lookup_slow(const at::RecordFunction& fn) {
  const char* key = fn.name();
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto range = g_facts->equal_range(key);
    for (auto it = range.first; it != range.second; ++it) {
      if (same_op(*it->second, fn)) {
        return *it->second;
      }
    }
  }
  const std::optional<c10::FunctionSchema> schema = fn.operator_schema();
  if (!schema.has_value()) {
    static const OpFacts* unknown = [] {
      auto* f = new OpFacts();
      f->transparent = true;
      return f;
    }();
    return *unknown;  // not cached: the name of a schema-less RecordFunction is its own string
  }
  auto facts = std::make_unique<OpFacts>(compute(*schema));
  std::lock_guard<std::mutex> lock(g_mutex);
  const OpFacts& out = *facts;
  g_facts->emplace(key, std::move(facts));
  return out;
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

}  // namespace torch_pipeline
