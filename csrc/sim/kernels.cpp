// Kernels of the sim device.
//
// Most ops go through sim_fallback: each sim tensor argument gets a CPU alias (a CPU tensor over
// the same host memory, with the same sizes, strides and offset; aliases of one sim storage share
// one CPU storage, so the CPU kernels see overlap as they would on the CPU), the op's CPU kernel
// runs on the aliases, and its results come back as sim tensors: an argument it returns (in-place
// and out= ops) as the original sim tensor, a view of an argument as a sim view of the same
// storage, and a new tensor copied into sim memory allocated on the op's device and stream.
//
// Before the kernel runs, the op's accesses (the byte ranges of its sim tensor arguments, written
// where the schema's alias info says so) are recorded on the current stream of its device; in
// strict mode a race throws there, before any memory is touched. The memory an op allocates (new
// results, out= arguments the kernel resized) is recorded as written after the kernel. Views and
// other metadata-only ops record nothing.
#include "kernels.h"

#include "allocator.h"
#include "host.h"
#include "ops.h"
#include "state.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/is_set_to_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/SymIntArrayRef.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace sim {
namespace {

const c10::DispatchKeySet kSimKeys{c10::DispatchKey::PrivateUse1};

// ---- accesses --------------------------------------------------------------------------------
// The bytes of sim tensor `t` as access ranges (ops.h).
void add_accesses(const at::Tensor& t, bool write, std::vector<Access>& out) {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) {
    return;
  }
  const c10::Storage& storage = t.storage();
  add_accesses(t, write, describe_storage(t.device().index(), storage.data(), storage.nbytes()),
               out);
}

std::vector<Access> accesses_of(const at::Tensor& t, bool write) {
  std::vector<Access> out;
  add_accesses(t, write, out);
  return out;
}

// ---- CPU aliases of sim memory ----------------------------------------------------------------
// Storage of CPU aliases: a CPU kernel that resizes an out= alias gets sim memory (tagged as a CPU
// pointer), which the fallback then moves into the sim storage.
class AliasResizeAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    return retag(device_allocator()->allocate(n), c10::Device(c10::kCPU));
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

AliasResizeAllocator g_alias_allocator;

class AliasMap {
 public:
  struct Entry {
    c10::Storage sim;  // keeps the sim memory alive during the call
    c10::Storage cpu;
    void* data;
    size_t nbytes;
  };

  at::Tensor alias(const at::Tensor& t) {
    Entry& e = entry_for(t.storage());
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        c10::Storage(e.cpu), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
    impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
    copy_math_bits(t, impl.get());
    return at::Tensor(std::move(impl));
  }

  Entry* by_cpu(const c10::StorageImpl* cpu) {
    for (auto& e : entries_) {
      if (e.cpu.unsafeGetStorageImpl() == cpu) {
        return &e;
      }
    }
    return nullptr;
  }

  Entry* by_sim(const c10::StorageImpl* sim) {
    for (auto& e : entries_) {
      if (e.sim.unsafeGetStorageImpl() == sim) {
        return &e;
      }
    }
    return nullptr;
  }

 private:
  Entry& entry_for(const c10::Storage& sim) {
    if (Entry* e = by_sim(sim.unsafeGetStorageImpl())) {
      return *e;
    }
    void* data = const_cast<void*>(sim.data());
    const size_t nbytes = sim.nbytes();
    c10::Storage cpu(c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), static_cast<int64_t>(nbytes),
        c10::DataPtr(data, c10::Device(c10::kCPU)), &g_alias_allocator, /*resizable=*/true));
    entries_.push_back(Entry{sim, std::move(cpu), data, nbytes});
    return entries_.back();
  }

  std::deque<Entry> entries_;  // pointers stay valid
};

// A new sim tensor on the current device holding the values of CPU tensor `c`.
at::Tensor to_new_sim_tensor(const at::Tensor& c) {
  const bool dense = c.is_non_overlapping_and_dense();
  at::Tensor out = dense
      ? at::detail::empty_strided_generic(
            c.sizes(), c.strides(), device_allocator(), kSimKeys, c.scalar_type())
      : at::detail::empty_generic(
            c.sizes(), device_allocator(), kSimKeys, c.scalar_type(), std::nullopt);
  if (c.numel() > 0) {
    if (dense) {
      std::memcpy(out.mutable_data_ptr(), c.const_data_ptr(), c.numel() * c.element_size());
    } else {
      AliasMap map;
      map.alias(out).copy_(c.resolve_conj().resolve_neg());
      return out;
    }
  }
  copy_math_bits(c, out.unsafeGetTensorImpl());
  return out;
}

// A sim tensor viewing `sim` storage as CPU alias view `c` views its alias.
at::Tensor sim_view(const at::Tensor& c, const c10::Storage& sim) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(sim), kSimKeys, c.dtype());
  impl->set_sizes_and_strides(c.sizes(), c.strides(), c.storage_offset());
  copy_math_bits(c, impl.get());
  return at::Tensor(std::move(impl));
}

bool is_sim(const at::Tensor& t) {
  return t.defined() && t.device().type() == kSim;
}

// ---- the boxed fallback -------------------------------------------------------------------------
// Runs a CPU op on a stack of CPU aliases (default: the same op's CPU kernel).
using Runner = void (*)(const c10::OperatorHandle& op, torch::jit::Stack* stack);

void run_cpu_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
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

    std::vector<Access> reads_writes;
    for (size_t i = 0; i < nargs; ++i) {
      const bool w = facts_.write[i] != 0;
      c10::IValue& v = stack_[first + i];
      if (v.isTensor()) {
        const at::Tensor& tensor = v.toTensor();
        if (is_sim(tensor)) {
          v = to_alias(tensor, w, reads_writes);
        } else if (tensor.defined()) {
          cpu_inputs_.push_back(tensor.unsafeGetTensorImpl());
        }
      } else if (v.isTensorList()) {
        auto list = v.toTensorList();
        if (std::any_of(list.begin(), list.end(), [](const at::Tensor& x) { return is_sim(x); })) {
          c10::List<at::Tensor> aliases;
          aliases.reserve(list.size());
          for (size_t j = 0; j < list.size(); ++j) {
            const at::Tensor x = list.get(j);
            aliases.push_back(is_sim(x) ? to_alias(x, w, reads_writes) : x);
          }
          v = c10::IValue(std::move(aliases));
        }
      } else if (v.isOptionalTensorList()) {
        auto list = v.toOptionalTensorList();
        c10::List<std::optional<at::Tensor>> aliases;
        aliases.reserve(list.size());
        bool any = false;
        for (size_t j = 0; j < list.size(); ++j) {
          const std::optional<at::Tensor> x = list.get(j);
          if (x.has_value() && is_sim(*x)) {
            aliases.push_back(to_alias(*x, w, reads_writes));
            any = true;
          } else {
            aliases.push_back(x);
          }
        }
        if (any) {
          v = c10::IValue(std::move(aliases));
        }
      } else if (v.isDevice() && v.toDevice().type() == kSim) {
        v = c10::IValue(c10::Device(c10::kCPU));
      }
    }

    if (!facts_.metadata_only && !reads_writes.empty()) {
      record(t, facts_.name, reads_writes);  // strict mode: throws before the kernel runs
    }

    std::vector<Access> reused;   // cached blocks this op's allocations reuse
    std::vector<Access> created;  // results and resized out= arguments
    {
      DeferReuseReports defer(&reused);
      runner_(op_, &stack_);
      for (auto& w : written_) {
        sync_back(w, device, created);
      }
      const size_t nrets = op_.schema().returns().size();
      for (size_t i = stack_.size() - nrets; i < stack_.size(); ++i) {
        stack_[i] = to_sim(stack_[i], created);
      }
    }
    if (!facts_.metadata_only) {
      std::vector<Access> post = std::move(reused);
      const size_t n_reused = post.size();
      for (auto& a : created) {
        const bool covered = std::any_of(post.begin(), post.begin() + n_reused, [&](const Access& r) {
          return r.begin <= a.begin && a.end <= r.end;
        });
        if (!covered) {
          post.push_back(std::move(a));
        }
      }
      if (!post.empty()) {
        record(t, facts_.name, post);
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
        TORCH_CHECK(
            d == device, "Expected all tensors to be on the same device, but found at least two "
            "devices, sim:", static_cast<int>(device), " and sim:", static_cast<int>(d), "! (when "
            "checking arguments of ", facts_.name, ")");
      }
    };
    c10::DeviceIndex from_device_arg = -1;
    bool has_device_arg = false;
    for (size_t i = 0; i < nargs; ++i) {
      const c10::IValue& v = stack_[first + i];
      if (v.isTensor()) {
        note(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& x : v.toTensorList()) {
          note(x);
        }
      } else if (v.isOptionalTensorList()) {
        for (const std::optional<at::Tensor>& x : v.toOptionalTensorList()) {
          if (x.has_value()) {
            note(*x);
          }
        }
      } else if (v.isDevice() && v.toDevice().type() == kSim && !has_device_arg) {
        has_device_arg = true;
        from_device_arg = v.toDevice().index();
      }
    }
    if (device < 0) {
      device = has_device_arg ? from_device_arg : -1;
    }
    return check_device(device);
  }

  at::Tensor to_alias(const at::Tensor& t, bool write, std::vector<Access>& accesses) {
    at::Tensor cpu = map_.alias(t);
    if (!facts_.metadata_only) {
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
    if (changed) {
      add_accesses(w.sim, /*write=*/true, created);
    }
  }

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

  const c10::OperatorHandle& op_;
  torch::jit::Stack& stack_;
  const OpFacts& facts_;
  Runner runner_;
  AliasMap map_;
  std::vector<std::pair<const c10::TensorImpl*, at::Tensor>> aliases_;  // CPU alias -> sim tensor
  std::vector<const c10::TensorImpl*> cpu_inputs_;
  std::vector<Written> written_;
};

void sim_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  FallbackCall(op, stack, &run_cpu_kernel).run();
}

// Convolutions on backends other than CPU/CUDA go through convolution_overrideable and its
// backward; on the CPU aliases, aten::convolution / convolution_backward do the work.
void run_convolution(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  static const auto conv =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution", "");
  conv.callBoxed(stack);
}

void run_convolution_backward(const c10::OperatorHandle&, torch::jit::Stack* stack) {
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

void convolution_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  FallbackCall(op, stack, &run_convolution).run();
}

void convolution_backward_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  FallbackCall(op, stack, &run_convolution_backward).run();
}

// ---- native kernels ---------------------------------------------------------------------------
c10::DeviceIndex device_index_of(std::optional<c10::Device> device) {
  if (!device.has_value() || device->type() != kSim) {
    return check_device(-1);
  }
  return check_device(device->index());
}

void check_factory_options(std::optional<c10::Layout> layout, std::optional<bool> pin_memory) {
  TORCH_CHECK(
      c10::layout_or_default(layout) == c10::Layout::Strided,
      "the sim device supports strided tensors only, got layout ", c10::layout_or_default(layout));
  TORCH_CHECK(
      !c10::pinned_memory_or_default(pin_memory), "pin_memory applies to CPU tensors only");
}

at::Tensor empty_memory_format(
    c10::SymIntArrayRef size, std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout, std::optional<c10::Device> device,
    std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  check_factory_options(layout, pin_memory);
  DeviceScope scope(device_index_of(device));
  return at::detail::empty_generic(
      C10_AS_INTARRAYREF_SLOW(size), device_allocator(), kSimKeys, c10::dtype_or_default(dtype),
      memory_format);
}

at::Tensor empty_strided(
    c10::SymIntArrayRef size, c10::SymIntArrayRef stride, std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout, std::optional<c10::Device> device,
    std::optional<bool> pin_memory) {
  check_factory_options(layout, pin_memory);
  DeviceScope scope(device_index_of(device));
  return at::detail::empty_strided_generic(
      C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride), device_allocator(),
      kSimKeys, c10::dtype_or_default(dtype));
}

at::Tensor as_strided(
    const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
    std::optional<c10::SymInt> storage_offset) {
  std::optional<int64_t> offset;
  if (storage_offset.has_value()) {
    offset = storage_offset->expect_int();
  }
  return at::native::as_strided_tensorimpl(
      self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride), offset);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(
    const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(
      self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  return at::native::unfold(self, dimension, size, step);
}

// Reallocating a storage on the current stream: a read of the old bytes it copies (recorded
// before, so strict mode raises before anything changes) and a write of the new block, with the
// reuse of a cached block folded in (recorded after). `grow` does the reallocation.
template <class Grow>
void record_reallocation(c10::StorageImpl* storage, size_t keep, const char* op, Grow grow) {
  const c10::DeviceIndex d = check_device(storage->device().index());
  DeviceScope scope(d);
  SimKernelScope kernel;
  const Timeline t = current_timeline(d);
  const void* old = storage->data();
  const std::string memory = describe_storage(d, old, storage->nbytes());
  if (old != nullptr && keep > 0) {
    const auto begin = reinterpret_cast<uintptr_t>(old);
    record(t, op, {Access{begin, begin + keep, /*write=*/false, memory}});
  }
  std::vector<Access> post;
  {
    DeferReuseReports defer(&post);
    grow();
  }
  const void* fresh = storage->data();
  if (fresh != old && fresh != nullptr && storage->nbytes() > 0) {
    const auto begin = reinterpret_cast<uintptr_t>(fresh);
    post.push_back(Access{begin, begin + storage->nbytes(), /*write=*/true,
                          describe_storage(d, fresh, storage->nbytes())});
  }
  if (!post.empty()) {
    record(t, op, post);
  }
}

const at::Tensor& resize_(
    const at::Tensor& self, c10::SymIntArrayRef size,
    std::optional<c10::MemoryFormat> memory_format) {
  const auto sizes = C10_AS_INTARRAYREF_SLOW(size);
  c10::StorageImpl* storage = self.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  if (storage == nullptr) {
    DeviceScope scope(check_device(self.device().index()));
    return at::native::resize_(self, sizes, memory_format);
  }
  // The CPU resize reallocates (and copies the old bytes) only when the storage is too small.
  const size_t needed = at::detail::computeStorageNbytesContiguous(
      sizes, self.dtype().itemsize(), self.storage_offset());
  const size_t keep = needed > storage->nbytes() ? storage->nbytes() : 0;
  record_reallocation(storage, keep, "aten::resize_", [&] {
    at::native::resize_(self, sizes, memory_format);
  });
  return self;
}

at::Tensor& set_source_storage_offset(
    at::Tensor& self, c10::Storage source, c10::SymInt storage_offset, c10::SymIntArrayRef size,
    c10::SymIntArrayRef stride) {
  DeviceScope scope(check_device(self.device().index()));
  return at::native::set_storage_cpu_(
      self, std::move(source), storage_offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size),
      C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  return at::native::set_(self, std::move(source));
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_empty(at::Tensor& self) {
  DeviceScope scope(check_device(self.device().index()));
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, device_allocator(), /*resizable=*/true);
  return self.set_(storage, 0, {0}, {});
}

bool is_set_to(const at::Tensor& self, const at::Tensor& tensor) {
  return at::native::is_set_to(self, tensor);
}

std::string copy_name(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  std::string name = "aten::copy_";
  if (src.device() != dst.device()) {
    name += " (" + src.device().str() + " -> " + dst.device().str() + ")";
  }
  if (non_blocking) {
    name += " non_blocking";
  }
  return name;
}

// copy_ between sim and cpu tensors or sim devices (aten::copy_ sends them here).
at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(src.defined() && dst.defined(), "copy_: undefined tensor");
  const bool src_sim = is_sim(src);
  const bool dst_sim = is_sim(dst);
  TORCH_CHECK(
      (src_sim || src.device().is_cpu()) && (dst_sim || dst.device().is_cpu()),
      "the sim device copies only between sim and cpu tensors, got ", src.device(), " -> ",
      dst.device());
  if (dst.numel() == 0) {
    return dst;
  }
  SimKernelScope kernel;
  auto& checker = State::get().checker();
  // The host side of a copy with pinned memory is an access too: a non_blocking one is pending
  // until the host synchronizes with the stream (pageable memory is copied synchronously).
  const at::Tensor& host = src_sim ? dst : src;
  std::vector<Access> host_bytes;
  const bool pinned = !(src_sim && dst_sim) && host.has_storage() &&
      is_pinned(host.storage().data()) && host_accesses(host, /*write=*/src_sim, host_bytes);
  const std::string name = copy_name(src, dst, non_blocking);
  std::optional<Timeline> sync;   // a blocking copy with the host: the host waits for it
  std::optional<Timeline> async;  // a non_blocking one with pinned memory: watched until then
  if (src_sim && dst_sim) {
    const c10::DeviceIndex sd = check_device(src.device().index());
    const c10::DeviceIndex dd = check_device(dst.device().index());
    std::vector<Access> accesses = accesses_of(src, false);
    add_accesses(dst, true, accesses);
    const Timeline td = current_timeline(dd);
    if (sd == dd) {
      record(td, name, accesses);
    } else {
      // Like CUDA: a two-way barrier between both devices' current streams around the copy.
      const Timeline ts = current_timeline(sd);
      checker.join_timeline(td, ts);
      record(td, name, accesses);
      checker.join_timeline(ts, td);
    }
  } else {
    const at::Tensor& device_side = src_sim ? src : dst;
    const Timeline t = current_timeline(check_device(device_side.device().index()));
    std::vector<Access> accesses = accesses_of(device_side, /*write=*/dst_sim);
    if (pinned) {
      accesses.insert(accesses.end(), host_bytes.begin(), host_bytes.end());
    }
    record(t, name, accesses);
    if (!non_blocking) {
      sync = t;
    } else if (pinned) {
      async = t;
    }
  }
  AliasMap map;
  at::Tensor s = src_sim ? map.alias(src) : src;
  at::Tensor d = dst_sim ? map.alias(dst) : dst;
  d.copy_(s, non_blocking);
  if (sync.has_value()) {
    host_sync(*sync);
  }
  if (async.has_value()) {
    watch_async_host_accesses(*async, host_bytes);
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& src, const at::Tensor& dst) {
  dst.resize_(src.sizes());
  return copy_from(src, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  SimKernelScope kernel;
  const Timeline t = current_timeline(check_device(self.device().index()));
  record(t, "aten::_local_scalar_dense", accesses_of(self, false));
  host_sync(t);  // .item() waits for the stream, as on CUDA
  AliasMap map;
  return at::_local_scalar_dense(map.alias(self));
}

void record_stream_kernel(at::Tensor& self, c10::Stream stream) {
  TORCH_CHECK(
      stream.device_type() == kSim, "record_stream of a sim tensor expects a sim stream, got a "
      "stream of ", stream.device());
  if (self.has_storage()) {
    record_stream(self.storage().data_ptr(), stream);
  }
}

}  // namespace

void resize_storage_bytes(const c10::Storage& storage, size_t nbytes) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
  const size_t keep = std::min(nbytes, impl->nbytes());
  record_reallocation(impl, keep, "aten::resize_ (storage)", [&] {
    c10::DataPtr fresh = device_allocator()->allocate(nbytes);
    if (keep > 0) {
      std::memcpy(fresh.get(), impl->data(), keep);
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(nbytes);
  });
}

void register_kernels() {
  auto* aten = new torch::Library(
      torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  aten->impl("empty.memory_format", TORCH_FN(empty_memory_format));
  aten->impl("empty_strided", TORCH_FN(empty_strided));
  aten->impl("as_strided", TORCH_FN(as_strided));
  aten->impl("view", TORCH_FN(view));
  aten->impl("_reshape_alias", TORCH_FN(reshape_alias));
  aten->impl("unfold", TORCH_FN(unfold));
  aten->impl("resize_", TORCH_FN(resize_));
  aten->impl("set_.source_Storage_storage_offset", TORCH_FN(set_source_storage_offset));
  aten->impl("set_.source_Storage", TORCH_FN(set_source_storage));
  aten->impl("set_.source_Tensor", TORCH_FN(set_source_tensor));
  aten->impl("set_", TORCH_FN(set_empty));
  aten->impl("is_set_to", TORCH_FN(is_set_to));
  aten->impl("_copy_from", TORCH_FN(copy_from));
  aten->impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  aten->impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  aten->impl("record_stream", TORCH_FN(record_stream_kernel));
  aten->impl(
      "convolution_overrideable",
      torch::CppFunction::makeFromBoxedFunction<&convolution_kernel>());
  aten->impl(
      "convolution_backward_overrideable",
      torch::CppFunction::makeFromBoxedFunction<&convolution_backward_kernel>());

  // copy_ resolves conjugate and negative bits itself and sends sim copies to _copy_from, whose
  // kernel above copies the bits' values too (its CPU aliases carry the bits): without these
  // fallthroughs the math-bit fallbacks would materialize the source with clone(), which copies
  // with _copy_from again, forever.
  for (auto key : {c10::DispatchKey::Conjugate, c10::DispatchKey::Negative}) {
    auto* bits = new torch::Library(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
    bits->impl("_copy_from", torch::CppFunction::makeFallthrough());
    bits->impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
  }

  auto* fallback = new torch::Library(
      torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  fallback->fallback(torch::CppFunction::makeFromBoxedFunction<&sim_fallback>());
}

void raw_kernel(const std::string& name, const std::vector<at::Tensor>& reads,
                const std::vector<at::Tensor>& writes) {
  std::vector<c10::DeviceIndex> devices;
  for (const auto* list : {&reads, &writes}) {
    for (const at::Tensor& t : *list) {
      TORCH_CHECK_VALUE(is_sim(t), "sim.raw_kernel takes sim tensors, got one on ", t.device());
      if (std::find(devices.begin(), devices.end(), t.device().index()) == devices.end()) {
        devices.push_back(t.device().index());
      }
    }
  }
  for (const c10::DeviceIndex d : devices) {
    std::vector<Access> accesses;
    for (const at::Tensor& t : reads) {
      if (t.device().index() == d) add_accesses(t, false, accesses);
    }
    for (const at::Tensor& t : writes) {
      if (t.device().index() == d) add_accesses(t, true, accesses);
    }
    record(current_timeline(check_device(d)), name, accesses);
  }
}

}  // namespace sim
}  // namespace torch_pipeline
