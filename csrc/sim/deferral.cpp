#include "deferral.h"

#include "aliases.h"
#include "allocator.h"
#include "executor.h"
#include "meta_plan.h"
#include "ops.h"
#include "state.h"

#include "../runtime/op_facts.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>

#include <algorithm>
#include <memory>
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

struct Output {  // a new result: where it is on the CPU stack, and its sim tensor's CPU alias
  size_t ret;
  int64_t elem;  // -1: the return itself; else the index in a returned list
  at::Tensor cpu;
};

size_t nbytes_of(const at::Tensor& t) {
  return t.defined() ? static_cast<size_t>(t.numel()) * t.element_size() : 0;
}

}  // namespace

bool try_defer(const c10::OperatorHandle& op, torch::jit::Stack* stack, const OpFacts& facts,
               Runner runner, Timeline t, UncheckedPlan* unchecked) {
  const auto& schema = op.schema();
  if (facts.syncs_host || draws_random_numbers(schema, facts)) {
    return false;
  }
  const size_t nargs = schema.arguments().size();
  const size_t first = stack->size() - nargs;
  std::vector<Argument> sims;
  CallKey key(facts.full_name);
  bool cacheable = true;
  bool deferrable = true;
  auto note = [&](const at::Tensor& x, bool write) {
    if (is_sim(x)) {
      sims.push_back(Argument{x, write});
    } else if (x.defined() && x.dim() != 0) {
      deferrable = false;  // CPU tensors may only be scalars (read at launch, as CUDA does)
    }
  };
  const c10::ArrayRef<c10::IValue> call(stack->data() + first, nargs);
  for (size_t i = 0; i < nargs; ++i) {
    const bool w = writes_argument(facts, i, call);
    const c10::IValue& v = (*stack)[first + i];
    if (v.isTensor()) {
      note(v.toTensor(), w);
    } else if (v.isTensorList()) {
      for (const at::Tensor& x : v.toTensorList().vec()) note(x, w);
    } else if (v.isOptionalTensorList()) {
      for (const auto& x : v.toOptionalTensorList().vec()) {
        if (x.has_value()) note(*x, w);
      }
    } else if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
      deferrable = false;  // nested tensors (c10d) and other lists: not worth guessing
    }
    if (cacheable) cacheable = key.add(v, schema.arguments()[i].type());
  }
  if (!deferrable || sims.empty()) {
    return false;
  }
  const std::shared_ptr<const Plan> plan =
      plan_for(op, *stack, first, sims, runner, cacheable ? &key : nullptr);
  if (!plan->deferrable || plan->check.load() == Plan::kDisagrees) {
    return false;
  }
  if (plan->check.load() == Plan::kUnchecked) {
    unchecked->plan = plan;
    for (const Argument& a : sims) {
      if (!a.write) continue;
      unchecked->written_sizes.push_back(a.sim.sizes().vec());
      unchecked->written_strides.push_back(a.sim.strides().vec());
      unchecked->written_bits.push_back(a.sim.is_conj() * 2 + a.sim.is_neg());
    }
    unchecked->arguments = std::move(sims);
    return false;
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
    if (!x.defined()) return x;
    at::Tensor copy = x.clone();  // a CPU scalar: its value now
    copy.unsafeGetTensorImpl()->set_wrapped_number(x.unsafeGetTensorImpl()->is_wrapped_number());
    return copy;
  };
  for (size_t i = 0; i < nargs; ++i) {
    cpu_stack.push_back(replace_tensors((*stack)[first + i], to_cpu, c10::Device(c10::kCPU)));
  }

  // The results, allocated now on the current stream.
  std::vector<Output> outputs;
  std::vector<Access> reused;
  std::vector<Access> created;
  torch::jit::Stack results;
  {
    DeferReuseReports defer(&reused);
    auto make = [&](const Result& r, size_t ret, int64_t elem) -> at::Tensor {
      if (r.kind == Result::kNone || r.kind == Result::kUndefined) return at::Tensor();
      if (r.kind == Result::kArgument) return sims[r.argument].sim;
      at::Tensor out = at::detail::empty_strided_generic(r.sizes, r.strides, device_allocator(),
                                                         kSimKeys, r.dtype);
      add_accesses(out, /*write=*/true, created);
      bytes += nbytes_of(out);
      outputs.push_back(Output{ret, elem, aliases.alias(out)});
      return out;
    };
    for (size_t r = 0; r < plan->returns.size(); ++r) {
      const auto& list = plan->lists[r];
      if (plan->returns[r].has_value()) {
        c10::List<at::Tensor> tensors;
        for (size_t j = 0; j < list.size(); ++j) {
          tensors.push_back(make(list[j], r, static_cast<int64_t>(j)));
        }
        results.emplace_back(std::move(tensors));
      } else if (list.front().kind == Result::kNone) {
        results.emplace_back();
      } else {
        results.emplace_back(make(list.front(), r, -1));
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
           // NB: a copy, so that `args` keeps the CPU aliases alive through the call. A boxed
           // out= kernel returning a tuple of Tensor& (the _linalg_svd.U family) drops its
           // arguments from the stack before it pushes those references: were the stack the
           // aliases' only owner, it would push freed TensorImpls (heap corruption on torch 2.11).
           torch::jit::Stack s = args;
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
