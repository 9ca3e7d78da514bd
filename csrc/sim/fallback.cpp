// The boxed fallback of the sim device: every aten op without a kernel of its own.
//
// Each sim tensor argument gets a CPU alias (aliases.h), the op's CPU kernel runs on the aliases,
// and its results come back as sim tensors: an argument it returns (in-place and out= ops) as the
// original sim tensor, a view of an argument as a sim view of the same storage, and a new tensor
// copied into sim memory allocated on the op's device and stream.
//
// Before the kernel runs, the op's accesses (the byte ranges of its sim tensor arguments, written
// where the op's facts say so: csrc/runtime/op_facts.h, the tracker's facts too) are recorded on
// the current stream of its device; in strict mode a race throws there, before any memory is
// touched. The memory an op allocates (new results, out= arguments the kernel resized) is
// recorded as written after the kernel. Views and other transparent ops record nothing.
//
// In asynchronous mode an op that touches data is queued on its stream where possible
// (deferral.h); otherwise it waits for the stream and runs at once, as here.
#include "fallback.h"

#include "aliases.h"
#include "allocator.h"
#include "deferral.h"
#include "executor.h"
#include "host.h"
#include "latency.h"
#include "meta_plan.h"
#include "state.h"
#include "trace.h"

#include "../runtime/ivalue_tensors.h"
#include "../runtime/op_facts.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace sim {
namespace {

// Default runner (deferral.h): the same op's kernel of the stack's backend.
void run_own_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                    c10::DispatchKeySet keys) {
  op.redispatchBoxed(keys, stack);
}

class FallbackCall {
 public:
  FallbackCall(const c10::OperatorHandle& op, torch::jit::Stack* stack, Runner runner)
      : op_(op), stack_(*stack), facts_(op_facts(op)), runner_(runner) {}

  void run() {
    SimKernelScope kernel;  // the CPU ops below are the device's, not the host's
    const size_t nargs = op_.schema().arguments().size();
    const size_t first = stack_.size() - nargs;
    const c10::DeviceIndex device = find_device(first, nargs);
    DeviceScope scope(device);
    const Timeline t = current_timeline(device);
    UncheckedPlan unchecked;
    if (asynchronous() && !facts_.transparent) {
      if (try_defer(op_, &stack_, facts_, runner_, t, &unchecked)) {
        return;
      }
      host_wait(t, /*report=*/false);  // a syncing op: what the stream queued runs first
    }

    std::vector<Access> reads_writes;
    replace_arguments(first, nargs, reads_writes);

    if (!facts_.transparent && !reads_writes.empty()) {
      record(t, facts_.full_name, reads_writes);  // strict mode: throws before the kernel runs
    }

    std::vector<Access> reused;   // cached blocks this op's allocations reuse
    std::vector<Access> created;  // results and resized out= arguments
    const int64_t traced = trace::on() && !facts_.transparent ? trace::now_ns() : 0;
    {
      DeferReuseReports defer(&reused);
      runner_(op_, &stack_, c10::DispatchKeySet(c10::DispatchKey::CPU));
      for (auto& w : written_) {
        sync_back(w, device, created);
      }
      const size_t nrets = op_.schema().returns().size();
      for (size_t i = stack_.size() - nrets; i < stack_.size(); ++i) {
        stack_[i] = to_sim(stack_[i], created);
      }
      if (unchecked.plan) {
        check_plan(unchecked, stack_, nrets);
      }
    }
    if (!facts_.transparent) {
      std::vector<Access> post = std::move(reused);
      const size_t n_reused = post.size();
      for (auto& a : created) {
        const bool covered =
            std::any_of(post.begin(), post.begin() + n_reused,
                        [&](const Access& r) { return r.begin <= a.begin && a.end <= r.end; });
        if (!covered) {
          post.push_back(std::move(a));
        }
      }
      if (!post.empty()) {
        record(t, facts_.full_name, post);
      }
      size_t bytes = 0;
      for (const auto* list : {&reads_writes, &post}) {
        for (const Access& a : *list) bytes += a.end - a.begin;
      }
      const auto time = modelled_time(facts_.full_name, bytes);
      if (time.count() > 0) {
        std::this_thread::sleep_for(time);  // the latency model, on the calling thread
      }
      if (traced != 0) {
        trace::kernel(t, facts_.full_name, traced, trace::now_ns());
      }
      if (facts_.syncs_host) {
        host_sync(t);
      }
    }
  }

 private:
  struct Written {
    at::Tensor sim;
    at::Tensor cpu;
  };

  // Replaces each sim tensor argument on the stack by its CPU alias (noting the accesses), and a
  // sim device argument by the CPU. Written by hand rather than with for_each_tensor, which only
  // reads: a tensor is replaced where it lies, and a list is rebuilt as a new list of its own type
  // (Tensor[], Tensor?[]), as the CPU kernel's unboxing expects. Tensors nested deeper (Tensor[][])
  // occur in c10d schemas only, whose sim kernels are c10d's own.
  void replace_arguments(size_t first, size_t nargs, std::vector<Access>& accesses) {
    const c10::ArrayRef<c10::IValue> args(stack_.data() + first, nargs);
    for (size_t i = 0; i < nargs; ++i) {
      const bool w = writes_argument(facts_, i, args);
      c10::IValue& v = stack_[first + i];
      if (v.isTensor()) {
        const at::Tensor& tensor = v.toTensor();
        if (is_sim(tensor)) {
          v = to_alias(tensor, w, accesses);
        } else if (tensor.defined()) {
          cpu_inputs_.push_back(tensor.unsafeGetTensorImpl());
        }
      } else if (v.isTensorList()) {
        if (any_tensor(v, is_sim)) {
          auto list = v.toTensorList();
          c10::List<at::Tensor> aliases;
          aliases.reserve(list.size());
          for (size_t j = 0; j < list.size(); ++j) {
            const at::Tensor x = list.get(j);
            aliases.push_back(is_sim(x) ? to_alias(x, w, accesses) : x);
          }
          v = c10::IValue(std::move(aliases));
        }
      } else if (v.isOptionalTensorList()) {
        if (any_tensor(v, is_sim)) {
          auto list = v.toOptionalTensorList();
          c10::List<std::optional<at::Tensor>> aliases;
          aliases.reserve(list.size());
          for (size_t j = 0; j < list.size(); ++j) {
            const std::optional<at::Tensor> x = list.get(j);
            const bool sim = x.has_value() && is_sim(*x);
            aliases.push_back(sim ? std::optional<at::Tensor>(to_alias(*x, w, accesses)) : x);
          }
          v = c10::IValue(std::move(aliases));
        }
      } else if (v.isDevice() && v.toDevice().type() == kSim) {
        v = c10::IValue(c10::Device(c10::kCPU));
      }
    }
  }

  c10::DeviceIndex find_device(size_t first, size_t nargs) {
    c10::DeviceIndex device = -1;
    auto note = [&](const at::Tensor& t) {
      if (!is_sim(t)) {
        return;
      }
      const c10::DeviceIndex d = t.device().index();
      if (device < 0) {
        device = d;
      } else {
        TORCH_CHECK(d == device,
                    "Expected all tensors to be on the same device, but found at least two "
                    "devices, sim:",
                    static_cast<int>(device), " and sim:", static_cast<int>(d),
                    "! (when "
                    "checking arguments of ",
                    facts_.full_name, ")");
      }
    };
    c10::DeviceIndex from_device_arg = -1;
    bool has_device_arg = false;
    for (size_t i = 0; i < nargs; ++i) {
      const c10::IValue& v = stack_[first + i];
      if (v.isDevice()) {
        if (v.toDevice().type() == kSim && !has_device_arg) {
          has_device_arg = true;
          from_device_arg = v.toDevice().index();
        }
      } else {
        for_each_tensor(v, note);
      }
    }
    if (device < 0) {
      device = has_device_arg ? from_device_arg : -1;
    }
    return check_device(device);
  }

  at::Tensor to_alias(const at::Tensor& t, bool write, std::vector<Access>& accesses) {
    at::Tensor cpu = map_.alias(t);
    if (!facts_.transparent) {
      add_accesses(t, write, accesses);
    }
    aliases_.emplace_back(cpu.unsafeGetTensorImpl(), t);
    if (write) {
      written_.push_back(Written{t, cpu});
    }
    return cpu;
  }

  // A written argument whose CPU alias the kernel resized or re-pointed: the sim tensor follows.
  void sync_back(Written& w, c10::DeviceIndex device, std::vector<Access>& created) {
    c10::TensorImpl* ci = w.cpu.unsafeGetTensorImpl();
    c10::TensorImpl* si = w.sim.unsafeGetTensorImpl();
    c10::StorageImpl* sim_storage = si->storage().unsafeGetStorageImpl();
    AliasMap::Entry* e = map_.by_sim(sim_storage);
    TORCH_INTERNAL_ASSERT(e != nullptr);
    c10::StorageImpl* cs = ci->storage().unsafeGetStorageImpl();
    bool changed = false;
    if (cs == e->cpu.unsafeGetStorageImpl()) {
      if (cs->data_ptr().get() != e->data || cs->nbytes() != e->nbytes) {
        // The kernel resized the alias: its new memory is a sim block tagged as CPU.
        void* data = cs->data_ptr().get();
        const size_t nbytes = cs->nbytes();
        c10::DataPtr moved = cs->set_data_ptr(c10::DataPtr(data, c10::Device(c10::kCPU)));
        if (moved.get() == data && is_block(moved)) {
          sim_storage->set_data_ptr_noswap(retag(std::move(moved), c10::Device(kSim, device)));
        } else {
          // Not our memory (the kernel installed some other pointer): copy it into a sim block.
          c10::DataPtr block = device_allocator()->allocate(nbytes);
          if (nbytes > 0) {
            std::memcpy(block.get(), data, nbytes);
          }
          cs->set_data_ptr_noswap(std::move(moved));  // keep it alive with the alias
          sim_storage->set_data_ptr_noswap(std::move(block));
        }
        sim_storage->set_nbytes(nbytes);
        e->data = data;
        e->nbytes = nbytes;
        changed = true;
      }
    } else {
      // The kernel gave the alias another storage (set_): copy that into a new sim storage.
      const size_t nbytes = cs != nullptr ? cs->nbytes() : 0;
      c10::Storage fresh(c10::Storage::use_byte_size_t(), static_cast<int64_t>(nbytes),
                         device_allocator(), /*resizable=*/true);
      if (nbytes > 0) {
        std::memcpy(fresh.mutable_data(), cs->data(), nbytes);
      }
      si->set_storage_keep_dtype(std::move(fresh));
      changed = true;
    }
    if (ci->sizes() != si->sizes() || ci->strides() != si->strides() ||
        ci->storage_offset() != si->storage_offset()) {
      si->set_sizes_and_strides(ci->sizes(), ci->strides(), ci->storage_offset());
    }
    // NB: a kernel may flip the math bits of an out= argument: linalg_lu_solve(left=False) solves
    // for the conjugate transpose in place and then sets the conjugate bit of its result.
    if (ci->is_conj() != si->is_conj()) si->_set_conj(ci->is_conj());
    if (ci->is_neg() != si->is_neg()) si->_set_neg(ci->is_neg());
    if (changed) {
      add_accesses(w.sim, /*write=*/true, created);
    }
  }

  // A result of the CPU kernel as the sim op's result. Rebuilds lists, as replace_arguments does
  // (for_each_tensor cannot make new values).
  c10::IValue to_sim(const c10::IValue& v, std::vector<Access>& created) {
    if (v.isTensor()) {
      return c10::IValue(to_sim_tensor(v.toTensor(), created));
    }
    if (v.isTensorList()) {
      auto list = v.toTensorList();
      c10::List<at::Tensor> out;
      out.reserve(list.size());
      for (size_t j = 0; j < list.size(); ++j) {
        out.push_back(to_sim_tensor(list.get(j), created));
      }
      return c10::IValue(std::move(out));
    }
    if (v.isOptionalTensorList()) {
      auto list = v.toOptionalTensorList();
      c10::List<std::optional<at::Tensor>> out;
      out.reserve(list.size());
      for (size_t j = 0; j < list.size(); ++j) {
        const std::optional<at::Tensor> x = list.get(j);
        out.push_back(x.has_value() ? std::optional<at::Tensor>(to_sim_tensor(*x, created)) : x);
      }
      return c10::IValue(std::move(out));
    }
    return v;
  }

  at::Tensor to_sim_tensor(const at::Tensor& c, std::vector<Access>& created) {
    if (!c.defined()) {
      return c;
    }
    check_strided_result(c);
    const c10::TensorImpl* impl = c.unsafeGetTensorImpl();
    for (const auto& [cpu, sim] : aliases_) {
      if (cpu == impl) {
        return sim;  // an argument returned as is (in-place and out= ops)
      }
    }
    for (const c10::TensorImpl* cpu : cpu_inputs_) {
      if (cpu == impl) {
        return c;
      }
    }
    if (c.has_storage()) {
      if (AliasMap::Entry* e = map_.by_cpu(c.storage().unsafeGetStorageImpl())) {
        return sim_view(c, e->sim);  // a view of an argument
      }
    }
    if (c.device().type() != c10::kCPU) {
      return c;
    }
    at::Tensor out = to_new_sim_tensor(c);
    add_accesses(out, /*write=*/true, created);
    return out;
  }

  // Sim tensors are strided: a nested or sparse result of the CPU kernel has no sim form.
  void check_strided_result(const at::Tensor& c) const {
    TORCH_CHECK_NOT_IMPLEMENTED(
        !c.is_nested(), "the sim device has no nested tensors, and ", facts_.full_name,
        " returned one. nn.TransformerEncoder makes them in eval mode when given a "
        "src_key_padding_mask: construct it with enable_nested_tensor=False to run it on sim");
    TORCH_CHECK_NOT_IMPLEMENTED(c.layout() == c10::kStrided,
                                "the sim device supports strided tensors only, and ",
                                facts_.full_name, " returned a tensor of layout ", c.layout());
  }

  const c10::OperatorHandle& op_;
  torch::jit::Stack& stack_;
  const OpFacts& facts_;
  Runner runner_;
  AliasMap map_;
  std::vector<std::pair<const c10::TensorImpl*, at::Tensor>> aliases_;  // CPU alias -> sim tensor
  std::vector<const c10::TensorImpl*> cpu_inputs_;
  std::vector<Written> written_;
};

// Convolutions on backends other than CPU/CUDA go through convolution_overrideable and its
// backward; on the CPU aliases, aten::convolution / convolution_backward do the work.
void run_convolution(const c10::OperatorHandle&, torch::jit::Stack* stack, c10::DispatchKeySet) {
  static const auto conv = c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution", "");
  conv.callBoxed(stack);
}

void run_convolution_backward(const c10::OperatorHandle&, torch::jit::Stack* stack,
                              c10::DispatchKeySet) {
  static const auto backward =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution_backward", "");
  // (grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups,
  // output_mask): convolution_backward takes bias_sizes after weight.
  const size_t first = stack->size() - 10;
  const at::Tensor& grad_output = (*stack)[first].toTensor();
  const bool bias = (*stack)[first + 9].toBoolList().get(2);
  c10::IValue bias_sizes;
  if (bias) {
    bias_sizes = c10::IValue(std::vector<int64_t>{grad_output.size(1)});
  }
  stack->insert(stack->begin() + static_cast<std::ptrdiff_t>(first + 3), std::move(bias_sizes));
  backward.callBoxed(stack);
}

}  // namespace

void sim_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  FallbackCall(op, stack, &run_own_kernel).run();
}

void convolution_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  FallbackCall(op, stack, &run_convolution).run();
}

void convolution_backward_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  FallbackCall(op, stack, &run_convolution_backward).run();
}

}  // namespace sim
}  // namespace torch_pipeline
