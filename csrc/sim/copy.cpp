// Copies between the sim device and the host or between sim devices (aten::copy_ sends them to
// _copy_from), .item() (_local_scalar_dense) and record_stream: the sim device's kernels that
// order streams with the host.
#include "copy.h"

#include "aliases.h"
#include "allocator.h"
#include "host.h"
#include "state.h"

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace sim {
namespace {

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

}  // namespace

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

}  // namespace sim
}  // namespace torch_pipeline
