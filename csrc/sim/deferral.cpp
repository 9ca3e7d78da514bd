#include "deferral.h"

#include "aliases.h"
#include "allocator.h"
#include "executor.h"
#include "ops.h"
#include "state.h"

#include "../runtime/op_facts.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>

#include <algorithm>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace sim {
namespace {

// Ops that draw random numbers without a Generator argument: run in program order, as the CPU's
// generator is shared with the host.
bool draws_random_numbers(const c10::FunctionSchema& schema, const OpFacts& facts) {
  for (const auto& arg : schema.arguments()) {
    if (arg.type()->str().find("Generator") != std::string::npos) {
      return true;
    }
  }
  return facts.name == "aten::native_dropout";
}

// Meta twins of sim tensors: tensors of one sim storage share one meta storage.
class MetaMap {
 public:
  at::Tensor meta(const at::Tensor& t) {
    c10::StorageImpl* sim = t.storage().unsafeGetStorageImpl();
    auto it = storages_.find(sim);
    if (it == storages_.end()) {
      c10::Storage storage(c10::make_intrusive<c10::StorageImpl>(
          c10::StorageImpl::use_byte_size_t(), static_cast<int64_t>(t.storage().nbytes()),
          c10::DataPtr(nullptr, c10::Device(c10::kMeta)), c10::GetAllocator(c10::kMeta),
          /*resizable=*/true));
      it = storages_.emplace(sim, std::move(storage)).first;
    }
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        c10::Storage(it->second), c10::DispatchKeySet(c10::DispatchKey::Meta), t.dtype());
    impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
    copy_math_bits(t, impl.get());
    return at::Tensor(std::move(impl));
  }

  bool owns(const at::Tensor& m) const {
    if (!m.has_storage()) return false;
    const c10::StorageImpl* s = m.storage().unsafeGetStorageImpl();
    return std::any_of(storages_.begin(), storages_.end(),
                       [&](const auto& e) { return e.second.unsafeGetStorageImpl() == s; });
  }

 private:
  std::unordered_map<const c10::StorageImpl*, c10::Storage> storages_;
};

size_t nbytes_of(const at::Tensor& t) {
  return t.defined() ? static_cast<size_t>(t.numel()) * t.element_size() : 0;
}

bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.storage_offset() == b.storage_offset();
}

struct Argument {  // a sim tensor argument
  at::Tensor sim;
  at::Tensor meta;
  bool write;
};

struct Output {  // a new result: where it is on the CPU stack, and its sim tensor's CPU alias
  size_t ret;
  int64_t elem;  // -1: the return itself; else the index in a returned list
  at::Tensor cpu;
};

}  // namespace

bool try_defer(const c10::OperatorHandle& op, torch::jit::Stack* stack, const OpFacts& facts,
               Runner runner, Timeline t) {
  const auto& schema = op.schema();
  if (facts.syncs_host || draws_random_numbers(schema, facts)) {
    return false;
  }
  const size_t nargs = schema.arguments().size();
  const size_t first = stack->size() - nargs;
  MetaMap metas;
  std::vector<Argument> sims;
  torch::jit::Stack meta_stack;
  meta_stack.reserve(nargs);
  bool deferrable = true;
  // A tensor argument's meta twin; CPU tensors may only be scalars (read at launch, as CUDA does).
  auto to_meta = [&](const at::Tensor& x, bool write) -> at::Tensor {
    if (is_sim(x)) {
      at::Tensor m = metas.meta(x);
      sims.push_back(Argument{x, m, write});
      return m;
    }
    if (x.defined() && x.dim() != 0) {
      deferrable = false;
    }
    return x;
  };
  for (size_t i = 0; i < nargs && deferrable; ++i) {
    const bool w = facts.write[i] != 0;
    const c10::IValue& v = (*stack)[first + i];
    if (v.isTensor()) {
      meta_stack.emplace_back(to_meta(v.toTensor(), w));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& x : v.toTensorList().vec()) list.push_back(to_meta(x, w));
      meta_stack.emplace_back(std::move(list));
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> list;
      for (const std::optional<at::Tensor>& x : v.toOptionalTensorList().vec()) {
        list.push_back(x.has_value() ? std::optional<at::Tensor>(to_meta(*x, w)) : x);
      }
      meta_stack.emplace_back(std::move(list));
    } else if (v.isDevice() && v.toDevice().type() == kSim) {
      meta_stack.emplace_back(c10::Device(c10::kMeta));
    } else if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
      deferrable = false;  // nested tensors (c10d) and other lists: not worth guessing
    } else {
      meta_stack.push_back(v);
    }
  }
  if (!deferrable || sims.empty()) {
    return false;
  }
  try {
    runner(op, &meta_stack, c10::DispatchKeySet(c10::DispatchKey::Meta));
  } catch (...) {
    return false;  // no meta kernel, data-dependent sizes, or an error the CPU kernel reports
  }
  // Written arguments keep their layout; results are written arguments or new tensors.
  for (const Argument& a : sims) {
    if (a.write && (!same_layout(a.sim, a.meta) ||
                    a.meta.storage().nbytes() != a.sim.storage().nbytes())) {
      return false;  // resized or re-pointed: run now
    }
  }
  enum class Kind { kNone, kArgument, kNew };
  auto classify = [&](const c10::IValue& v, const at::Tensor** sim) -> std::optional<Kind> {
    if (v.isNone()) return Kind::kNone;
    if (!v.isTensor()) return std::nullopt;
    const at::Tensor& m = v.toTensor();
    if (!m.defined()) return Kind::kNone;
    for (const Argument& a : sims) {
      if (a.meta.unsafeGetTensorImpl() == m.unsafeGetTensorImpl()) {
        *sim = &a.sim;
        return Kind::kArgument;
      }
    }
    if (!m.is_meta() || metas.owns(m) || m.storage_offset() != 0 || m.is_conj() || m.is_neg()) {
      return std::nullopt;  // a view of an input, or something unusual
    }
    return Kind::kNew;
  };
  for (const c10::IValue& v : meta_stack) {
    const at::Tensor* unused = nullptr;
    if (v.isTensorList()) {
      for (const at::Tensor& m : v.toTensorList().vec()) {
        if (!classify(c10::IValue(m), &unused).has_value()) return false;
      }
    } else if (!classify(v, &unused).has_value()) {
      return false;
    }
  }

  // Deferred from here on: record the accesses (strict mode raises here, before any allocation).
  std::vector<Access> accesses;
  size_t bytes = 0;
  for (const Argument& a : sims) {
    add_accesses(a.sim, a.write, accesses);
    bytes += nbytes_of(a.sim);
  }
  record(t, facts.full_name, accesses);

  AliasMap aliases;  // CPU aliases that do not own sim memory (the queued kernel holds only them)
  torch::jit::Stack cpu_stack;
  cpu_stack.reserve(nargs);
  auto to_cpu = [&](const at::Tensor& x) -> at::Tensor {
    if (is_sim(x)) return aliases.alias(x);
    return x.defined() ? x.clone() : x;  // a CPU scalar: its value now
  };
  for (size_t i = 0; i < nargs; ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (v.isTensor()) {
      cpu_stack.emplace_back(to_cpu(v.toTensor()));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& x : v.toTensorList().vec()) list.push_back(to_cpu(x));
      cpu_stack.emplace_back(std::move(list));
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> list;
      for (const std::optional<at::Tensor>& x : v.toOptionalTensorList().vec()) {
        list.push_back(x.has_value() ? std::optional<at::Tensor>(to_cpu(*x)) : x);
      }
      cpu_stack.emplace_back(std::move(list));
    } else if (v.isDevice() && v.toDevice().type() == kSim) {
      cpu_stack.emplace_back(c10::Device(c10::kCPU));
    } else {
      cpu_stack.push_back(v);
    }
  }

  // The results, allocated now on the current stream.
  std::vector<Output> outputs;
  std::vector<Access> reused;
  std::vector<Access> created;
  torch::jit::Stack results;
  {
    DeferReuseReports defer(&reused);
    auto make = [&](const at::Tensor& m, size_t ret, int64_t elem) -> at::Tensor {
      const at::Tensor* sim = nullptr;
      const Kind kind = *classify(c10::IValue(m), &sim);
      if (kind == Kind::kNone) return at::Tensor();
      if (kind == Kind::kArgument) return *sim;
      at::Tensor out = at::detail::empty_strided_generic(
          m.sizes(), m.strides(), device_allocator(), kSimKeys, m.scalar_type());
      add_accesses(out, /*write=*/true, created);
      bytes += nbytes_of(out);
      outputs.push_back(Output{ret, elem, aliases.alias(out)});
      return out;
    };
    for (size_t r = 0; r < meta_stack.size(); ++r) {
      const c10::IValue& v = meta_stack[r];
      if (v.isTensorList()) {
        c10::List<at::Tensor> list;
        const auto ms = v.toTensorList().vec();
        for (size_t j = 0; j < ms.size(); ++j) list.push_back(make(ms[j], r, static_cast<int64_t>(j)));
        results.emplace_back(std::move(list));
      } else if (v.isNone()) {
        results.push_back(v);
      } else {
        results.emplace_back(make(v.toTensor(), r, -1));
      }
    }
  }
  std::vector<Access> post = std::move(reused);
  const size_t n_reused = post.size();
  for (auto& a : created) {
    const bool covered = std::any_of(post.begin(), post.begin() + n_reused, [&](const Access& r) {
      return r.begin <= a.begin && a.end <= r.end;
    });
    if (!covered) post.push_back(std::move(a));
  }
  if (!post.empty()) {
    record(t, facts.full_name, post);
  }

  launch(t, facts.full_name, bytes,
         [op, runner, args = std::move(cpu_stack), outputs = std::move(outputs)]() mutable {
           torch::jit::Stack s = std::move(args);  // runs once
           runner(op, &s, c10::DispatchKeySet(c10::DispatchKey::CPU));
           for (Output& o : outputs) {
             const c10::IValue& v = s[o.ret];
             const at::Tensor r = o.elem < 0 ? v.toTensor() : v.toTensorList().get(o.elem);
             if (r.unsafeGetTensorImpl() != o.cpu.unsafeGetTensorImpl()) {
               o.cpu.copy_(r);
             }
           }
         });
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  for (auto& v : results) stack->push_back(std::move(v));
  return true;
}

}  // namespace sim
}  // namespace torch_pipeline
