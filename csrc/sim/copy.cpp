// Copies between the sim device and the host or between sim devices (aten::copy_ sends them to
// _copy_from), .item() (_local_scalar_dense) and record_stream: the sim device's kernels that
// order streams with the host. In asynchronous mode (executor.h) a copy is queued on its stream:
// a blocking copy to the host then waits for it, a non_blocking one with pinned memory completes
// later, and a non_blocking one from pageable memory takes a snapshot of the source at once.
#include "copy.h"

#include "aliases.h"
#include "allocator.h"
#include "executor.h"
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
  TORCH_CHECK((src_sim || src.device().is_cpu()) && (dst_sim || dst.device().is_cpu()),
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
                      is_pinned(host.storage().data()) &&
                      host_accesses(host, /*write=*/src_sim, host_bytes);
  const std::string name = copy_name(src, dst, non_blocking);
  std::optional<Timeline> sync;   // a blocking copy with the host: the host waits for it
  std::optional<Timeline> async;  // a non_blocking one with pinned memory: watched until then
  Timeline run_on = kHost;        // the stream that moves the bytes
  std::optional<Timeline> source_stream;  // across devices: the source device's stream
  if (src_sim && dst_sim) {
    const c10::DeviceIndex sd = check_device(src.device().index());
    const c10::DeviceIndex dd = check_device(dst.device().index());
    std::vector<Access> accesses = accesses_of(src, false);
    add_accesses(dst, true, accesses);
    const Timeline td = current_timeline(dd);
    run_on = td;
    if (sd == dd) {
      record(td, name, accesses);
    } else {
      // Like CUDA: a two-way barrier between both devices' current streams around the copy.
      const Timeline ts = current_timeline(sd);
      checker.join_timeline(td, ts);
      record(td, name, accesses);
      checker.join_timeline(ts, td);
      source_stream = ts;
    }
  } else {
    const at::Tensor& device_side = src_sim ? src : dst;
    const Timeline t = current_timeline(check_device(device_side.device().index()));
    std::vector<Access> accesses = accesses_of(device_side, /*write=*/dst_sim);
    if (pinned) {
      accesses.insert(accesses.end(), host_bytes.begin(), host_bytes.end());
    }
    record(t, name, accesses);
    run_on = t;
    if (!non_blocking) {
      sync = t;
    } else if (pinned) {
      async = t;
    }
  }
  AliasMap map;
  at::Tensor s = src_sim ? map.alias(src) : host_alias(src);
  at::Tensor d = dst_sim ? map.alias(dst) : host_alias(dst);
  if (!src_sim && non_blocking && !pinned && asynchronous()) {
    s = s.clone();  // pageable memory: staged now, as CUDA does, so the host may reuse it
  }
  const size_t bytes = static_cast<size_t>(dst.numel()) * dst.element_size();
  if (source_stream.has_value()) {
    stream_wait(run_on, *source_stream, stream_position(*source_stream));
  }
  // The closure holds the host memory (so pinned memory outlives the copy, as CUDA's caching host
  // allocator keeps it) through a host_alias, never the program's tensor, and CPU aliases that do
  // not own sim memory (freed blocks go back to the cache at once, as on CUDA).
  launch(run_on, name, bytes, [s, d]() mutable { d.copy_(s); });
  if (source_stream.has_value()) {
    stream_wait(*source_stream, run_on, stream_position(run_on));
  }
  if (sync.has_value()) {
    host_sync(*sync);
  } else if (src_sim && !dst_sim && !pinned) {
    host_wait(run_on);  // to pageable memory: the host waits for it even when non_blocking
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
  TORCH_CHECK(stream.device_type() == kSim,
              "record_stream of a sim tensor expects a sim stream, got a "
              "stream of ",
              stream.device());
  if (self.has_storage()) {
    record_stream(self.storage().data_ptr(), stream);
  }
}

}  // namespace sim
}  // namespace torch_pipeline
