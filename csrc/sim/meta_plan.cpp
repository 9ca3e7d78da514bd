#include "meta_plan.h"

#include "aliases.h"
#include "ops.h"
#include "state.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>

#include <algorithm>
#include <unordered_map>
#include <utility>

namespace torch_pipeline {
namespace sim {
namespace {

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

bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.storage_offset() == b.storage_offset();
}

// ---- the key of a call: everything the output metadata may depend on ----------------------------
template <class T>
void put(std::string& key, const T& v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// A list of plain values: its tag, the values, an end mark.
template <class T>
bool put_list(std::string& key, char tag, const std::vector<T>& values) {
  key += tag;
  for (const T& x : values) put(key, x);
  key += ';';
  return true;
}

bool is_scalar(const c10::TypePtr& type) {  // a Scalar: only its type matters for metadata
  if (type->kind() == c10::TypeKind::OptionalType) {
    return is_scalar(type->castRaw<c10::OptionalType>()->getElementType());
  }
  return type->kind() == c10::TypeKind::NumberType;
}

// Plans by key, per thread (no lock; threads that issue ops are few), bounded.
constexpr size_t kMaxPlans = 4096;
thread_local std::unordered_map<std::string, std::shared_ptr<const Plan>> tls_plans;

// Runs the op on meta twins of its sim arguments and describes its results.
std::shared_ptr<const Plan> make_plan(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                      size_t first, const std::vector<Argument>& sims,
                                      Runner runner) {
  auto plan = std::make_shared<Plan>();
  const size_t nargs = stack.size() - first;
  MetaMap metas;
  std::vector<at::Tensor> meta_args;
  torch::jit::Stack meta_stack;
  meta_stack.reserve(nargs);
  auto to_meta = [&](const at::Tensor& x) -> at::Tensor {
    if (!is_sim(x)) return x;
    at::Tensor m = metas.meta(x);
    meta_args.push_back(m);
    return m;
  };
  for (size_t i = first; i < stack.size(); ++i) {
    meta_stack.push_back(replace_tensors(stack[i], to_meta, c10::Device(c10::kMeta)));
  }
  TORCH_INTERNAL_ASSERT(meta_args.size() == sims.size());
  try {
    runner(op, &meta_stack, c10::DispatchKeySet(c10::DispatchKey::Meta));
  } catch (...) {
    return plan;  // no meta kernel, data-dependent sizes, or an error the CPU kernel reports
  }
  // Written arguments keep their layout (else they were resized or re-pointed: run now).
  for (size_t k = 0; k < sims.size(); ++k) {
    if (sims[k].write && (!same_layout(sims[k].sim, meta_args[k]) ||
                          meta_args[k].storage().nbytes() != sims[k].sim.storage().nbytes())) {
      return plan;
    }
  }
  auto describe = [&](const at::Tensor& m, Result& r) -> bool {
    if (!m.defined()) {
      r.kind = Result::kUndefined;
      return true;
    }
    for (size_t k = 0; k < meta_args.size(); ++k) {
      if (meta_args[k].unsafeGetTensorImpl() == m.unsafeGetTensorImpl()) {
        r.kind = Result::kArgument;
        r.argument = k;
        return true;
      }
    }
    if (!m.is_meta() || metas.owns(m) || m.storage_offset() != 0 || m.is_conj() || m.is_neg()) {
      return false;  // a view of an input, or something unusual
    }
    r.kind = Result::kNew;
    r.sizes = m.sizes().vec();
    r.strides = m.strides().vec();
    r.dtype = m.scalar_type();
    return true;
  };
  for (const c10::IValue& v : meta_stack) {
    std::vector<Result> results;
    if (v.isTensorList()) {
      for (const at::Tensor& m : v.toTensorList().vec()) {
        results.emplace_back();
        if (!describe(m, results.back())) return plan;
      }
      plan->returns.emplace_back(std::vector<Result>());
    } else if (v.isNone() || v.isTensor()) {
      results.emplace_back();
      if (v.isTensor() && !describe(v.toTensor(), results.back())) return plan;
      plan->returns.emplace_back(std::nullopt);
    } else {
      return plan;  // a host value
    }
    plan->lists.push_back(std::move(results));
  }
  plan->deferrable = true;
  return plan;
}

}  // namespace

bool CallKey::add(const c10::IValue& v, const c10::TypePtr& type) {
  if (v.isTensor()) return tensor(v.toTensor());
  if (v.isTensorList()) {
    key_ += 'L';
    put(key_, v.toTensorList().size());
    for (const at::Tensor& t : v.toTensorList().vec()) tensor(t);
    return true;
  }
  if (v.isOptionalTensorList()) {
    key_ += 'O';
    put(key_, v.toOptionalTensorList().size());
    for (const auto& t : v.toOptionalTensorList().vec()) tensor(t.has_value() ? *t : at::Tensor());
    return true;
  }
  const bool scalar = is_scalar(type);
  if (v.isNone()) {
    key_ += 'N';
    return true;
  }
  if (v.isDouble()) {
    key_ += 'd';
    if (!scalar) put(key_, v.toDouble());
    return true;
  }
  if (v.isInt()) {
    key_ += 'i';
    if (!scalar) put(key_, v.toInt());
    return true;
  }
  if (v.isBool()) {
    key_ += 'b';
    if (!scalar) put(key_, v.toBool());
    return true;
  }
  if (v.isComplexDouble()) {
    key_ += 'c';
    return scalar;
  }
  if (v.isIntList()) return put_list(key_, 'I', v.toIntList().vec());
  if (v.isDoubleList()) return put_list(key_, 'D', v.toDoubleList().vec());
  if (v.isBoolList()) return put_list(key_, 'B', v.toBoolList().vec());
  if (v.isString()) {
    key_ += 's';
    key_ += v.toStringRef();
    key_ += '\0';
    return true;
  }
  if (v.isDevice()) {
    key_ += 'v';
    put(key_, v.toDevice().type());
    put(key_, v.toDevice().index());
    return true;
  }
  return false;
}

bool CallKey::tensor(const at::Tensor& t) {
  if (!t.defined()) {
    key_ += 'U';
    return true;
  }
  if (!is_sim(t)) {  // a CPU scalar: its dtype and whether it is a wrapped number
    key_ += t.unsafeGetTensorImpl()->is_wrapped_number() ? 'w' : 'C';
    put(key_, t.scalar_type());
    return true;
  }
  key_ += 'T';
  put(key_, t.scalar_type());
  put(key_, t.dim());
  for (int64_t x : t.sizes()) put(key_, x);
  for (int64_t x : t.strides()) put(key_, x);
  put(key_, t.storage_offset());
  put(key_, t.storage().nbytes());
  put(key_, static_cast<uint8_t>(t.is_conj() * 2 + t.is_neg()));
  // which earlier argument shares its storage (in-place overlap checks depend on it)
  const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  size_t ordinal = 0;
  while (ordinal < storages_.size() && storages_[ordinal] != s) ++ordinal;
  if (ordinal == storages_.size()) storages_.push_back(s);
  put(key_, ordinal);
  return true;
}

std::shared_ptr<const Plan> plan_for(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                     size_t first, const std::vector<Argument>& sims, Runner runner,
                                     const CallKey* key) {
  if (key != nullptr) {
    auto it = tls_plans.find(key->str());
    if (it != tls_plans.end()) {
      return it->second;
    }
  }
  std::shared_ptr<const Plan> plan = make_plan(op, stack, first, sims, runner);
  if (key != nullptr) {
    if (tls_plans.size() >= kMaxPlans) {
      tls_plans.clear();
    }
    tls_plans.emplace(key->str(), plan);
  }
  return plan;
}

namespace {

bool agrees(const Result& r, const c10::IValue& v, const std::vector<Argument>& arguments) {
  if (r.kind == Result::kNone) return v.isNone();
  if (!v.isTensor()) return false;
  const at::Tensor& t = v.toTensor();
  if (r.kind == Result::kUndefined) return !t.defined();
  if (!t.defined()) return false;
  if (r.kind == Result::kArgument) {
    return t.unsafeGetTensorImpl() == arguments[r.argument].sim.unsafeGetTensorImpl();
  }
  for (const Argument& a : arguments) {
    if (a.sim.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return false;
  }
  return t.sizes().vec() == r.sizes && t.strides().vec() == r.strides &&
         t.scalar_type() == r.dtype && t.storage_offset() == 0 && !t.is_conj() && !t.is_neg();
}

bool agrees(const Plan& plan, const c10::IValue* results, size_t nrets,
            const std::vector<Argument>& arguments) {
  if (plan.returns.size() != nrets) return false;
  for (size_t r = 0; r < nrets; ++r) {
    const c10::IValue& v = results[r];
    const std::vector<Result>& list = plan.lists[r];
    if (plan.returns[r].has_value()) {
      if (!v.isTensorList() || v.toTensorList().size() != list.size()) return false;
      const auto tensors = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        if (!agrees(list[j], c10::IValue(tensors.get(j)), arguments)) return false;
      }
    } else if (!agrees(list.front(), v, arguments)) {
      return false;
    }
  }
  return true;
}

}  // namespace

void check_plan(const UncheckedPlan& unchecked, const torch::jit::Stack& stack, size_t nrets) {
  TORCH_INTERNAL_ASSERT(stack.size() >= nrets);
  bool ok =
      agrees(*unchecked.plan, stack.data() + (stack.size() - nrets), nrets, unchecked.arguments);
  size_t w = 0;
  for (const Argument& a : unchecked.arguments) {
    if (!a.write) continue;
    ok = ok && a.sim.sizes().vec() == unchecked.written_sizes[w] &&
         a.sim.strides().vec() == unchecked.written_strides[w] &&
         a.sim.is_conj() * 2 + a.sim.is_neg() == unchecked.written_bits[w];
    ++w;
  }
  unchecked.plan->check.store(ok ? Plan::kAgrees : Plan::kDisagrees);
}

}  // namespace sim
}  // namespace torch_pipeline
