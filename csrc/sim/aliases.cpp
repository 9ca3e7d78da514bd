#include "aliases.h"

#include "allocator.h"
#include "names.h"
#include "ops.h"
#include "sim.h"
#include "state.h"

#include <ATen/EmptyTensor.h>
#include <c10/util/StringUtil.h>

#include <cstring>
#include <utility>

namespace torch_pipeline {
namespace sim {
namespace {

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

}  // namespace

bool is_sim(const at::Tensor& t) { return t.defined() && t.device().type() == kSim; }

void add_accesses(const at::Tensor& t, bool write, std::vector<Access>& out) {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) {
    return;
  }
  const c10::Storage& storage = t.storage();
  std::string memory = describe_storage(t.device().index(), storage.data(), storage.nbytes());
  if (record_sites()) {  // Note [Race reports with sites]: the tensor too
    memory += c10::str(", tensor ", t.scalar_type(), t.sizes());
    const std::string name = StorageNames::get().find(storage.data());
    if (!name.empty()) {
      memory += " = " + name;
    }
  }
  add_accesses(t, write, memory, out);
}

std::vector<Access> accesses_of(const at::Tensor& t, bool write) {
  std::vector<Access> out;
  add_accesses(t, write, out);
  return out;
}

at::Tensor AliasMap::alias(const at::Tensor& t) {
  Entry& e = entry_for(t.storage());
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(e.cpu), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  copy_math_bits(t, impl.get());
  return at::Tensor(std::move(impl));
}

AliasMap::Entry* AliasMap::by_cpu(const c10::StorageImpl* cpu) {
  for (auto& e : entries_) {
    if (e.cpu.unsafeGetStorageImpl() == cpu) {
      return &e;
    }
  }
  return nullptr;
}

AliasMap::Entry* AliasMap::by_sim(const c10::StorageImpl* sim) {
  for (auto& e : entries_) {
    if (e.sim.unsafeGetStorageImpl() == sim) {
      return &e;
    }
  }
  return nullptr;
}

AliasMap::Entry& AliasMap::entry_for(const c10::Storage& sim) {
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

at::Tensor host_alias(const at::Tensor& t) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(t.storage()), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  copy_math_bits(t, impl.get());
  return at::Tensor(std::move(impl));
}

at::Tensor to_new_sim_tensor(const at::Tensor& c) {
  const bool dense = c.is_non_overlapping_and_dense();
  at::Tensor out = dense
                       ? at::detail::empty_strided_generic(
                             c.sizes(), c.strides(), device_allocator(), kSimKeys, c.scalar_type())
                       : at::detail::empty_generic(c.sizes(), device_allocator(), kSimKeys,
                                                   c.scalar_type(), std::nullopt);
  if (c._is_zerotensor()) {
    // An efficient zero tensor (forward-mode AD's zero tangents, _efficientzerotensor) has no
    // memory to copy: its sim result is a tensor of zeros.
    if (out.storage().nbytes() > 0) {
      std::memset(out.mutable_data_ptr(), 0, out.storage().nbytes());
    }
  } else if (c.numel() > 0) {
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

at::Tensor sim_view(const at::Tensor& c, const c10::Storage& sim) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(sim), kSimKeys, c.dtype());
  impl->set_sizes_and_strides(c.sizes(), c.strides(), c.storage_offset());
  copy_math_bits(c, impl.get());
  return at::Tensor(std::move(impl));
}

}  // namespace sim
}  // namespace torch_pipeline
