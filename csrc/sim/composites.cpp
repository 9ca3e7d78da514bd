// A sim op computes what its CPU kernel computes. The fallback runs an op's CPU kernel only where
// the dispatcher finds no other kernel for PrivateUse1; an op with a CompositeExplicitAutograd
// kernel (written in other aten ops, for backends without a kernel of their own) would run that
// instead, whose rounding differs from the CPU kernel's (native_layer_norm's composite differs by
// 1e-7..1e-4). For each op that has both, the fallback is registered as its sim kernel. The same
// for an op with a CPU kernel, a CompositeImplicitAutograd one and an autograd formula of its own
// (silu_backward, mish_backward, native_channel_shuffle): without a sim kernel, the dispatcher
// gives AutogradPrivateUse1 the decomposition (silu_backward through sigmoid: 1 ulp off the CPU's
// fused kernel); with one, sim takes the CPU's path, autograd formula and kernel.
//
// Two structured ops reach their out= kernel through CompositeExplicitAutogradNonFunctional with
// the reduced output, which that kernel's TensorIterator resizes to the elementwise loss first:
// correct values, but a deprecation warning ("An output with one or more elements was resized")
// that the CPU's own functional kernel never gives. Sim runs their CPU functional kernel instead
// (kWarnsThroughOut).
//
// scaled_dot_product_attention (a composite) picks its kernel by asking a per-device stub, which
// has no entry for PrivateUse1, so it would run the unfused math kernel; sim's entry answers what
// the CPU's does (the flash kernel for CPU where it applies), and that kernel runs by the fallback.
#include "extra_kernels.h"

#include "fallback.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_native.h>

#include <string>

namespace torch_pipeline {
namespace sim {

namespace {
constexpr const char* kWarnsThroughOut[] = {"mse_loss", "smooth_l1_loss"};
}  // namespace

void register_cpu_kernels_over_composites(torch::Library& aten) {
  for (const char* name : kWarnsThroughOut) {
    aten.impl(name, torch::CppFunction::makeFromBoxedFunction<&sim_fallback>());
  }
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) {
      continue;
    }
    const auto op = dispatcher.findOp(name);
    if (!op.has_value() || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      continue;
    }
    // (Not CompositeExplicitAutogradNonFunctional: that is how a structured op's functional and
    // in-place variants reach its out= kernel, the same CPU kernel, through sim memory the
    // dispatcher allocates; the tracker sees those inner out= ops.)
    const bool implicit_with_formula =
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
        op->hasKernelForDispatchKey(c10::DispatchKey::Autograd);
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
        implicit_with_formula) {
      std::string unqualified = name.name.substr(6);
      if (!name.overload_name.empty()) {
        unqualified += "." + name.overload_name;
      }
      aten.impl(unqualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&sim_fallback>());
    }
  }
  at::native::_fused_sdp_choice_stub.set_privateuse1_dispatch_ptr(
      &at::native::_fused_sdp_choice_cpp);
}

}  // namespace sim
}  // namespace torch_pipeline
