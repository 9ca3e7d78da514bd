// The sim device (docs/design.md, "The sim device"): PyTorch's PrivateUse1 backend, renamed "sim"
// by the Python layer, with host memory, a CUDA-like caching allocator, logical streams and
// events, eager CPU kernels and a race checker (race_checker.h) that sees every access of every
// op.
//
// Nothing is registered with PyTorch until enable() runs. This header is what the bindings use.
#pragma once

#include "race_checker.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace sim {

// Registers the sim backend with c10 and the dispatcher (guard, allocator, hooks, kernels) and
// makes `num_devices` devices. Idempotent; a second call with another count is a ValueError. A
// second call sets the strict flag. Throws RuntimeError when PrivateUse1 is taken by another
// backend.
void enable(int num_devices, bool strict);
bool enabled();
int num_devices();

// Races detected since the last clear_races().
std::vector<Race> races();
void clear_races();
// Strict mode: the racing op throws (before its kernel runs, where the race is seen then).
void set_strict(bool strict);
bool strict();

// Waits for (joins into the host clock) every stream of `device`, or of every device when -1;
// ValueError for any other negative value or a device that does not exist.
void synchronize(int device);

// Streams, as the DeviceGuardImpl gives them (for tests and tools): a stream of the pool of 32 per
// priority (round robin, like CUDA's; torch.Stream() draws from the same pools), and a stream's
// priority and race-report label.
c10::Stream stream_from_pool(int device, bool high_priority);
int stream_priority(const c10::Stream& stream);
std::string stream_label(const c10::Stream& stream);

// A kernel the dispatcher never sees (a raw launch on data pointers, as custom CUDA code does):
// checks and records its accesses of sim tensors on the current stream of their device, named
// `name`. Strict mode raises as for an op. Values are left as they are.
void raw_kernel(const std::string& name, const std::vector<at::Tensor>& reads,
                const std::vector<at::Tensor>& writes);

// The pinned host allocator's statistics, flat, under torch.cuda.host_memory_stats' names
// ("allocations.current", "active_bytes.peak", "num_host_alloc", ...).
std::vector<std::pair<std::string, int64_t>> host_memory_stats();
// Gives the pinned host allocator's cached blocks back (torch.accelerator.empty_host_cache(),
// for the torch versions that have it, calls the same).
void empty_host_cache();

// Number of access records the checker keeps (for tests).
size_t history_size();
// Number of host byte ranges of non_blocking copies the host-side check still watches (for tests).
size_t pending_host_accesses();

// What a racing op throws in strict mode, unless the bindings install a thrower of their own
// (they throw an exception that Python sees as torch_pipeline.sim.RaceError).
class RaceError : public c10::Error {
  using c10::Error::Error;
};
using RaceThrower = void (*)(const std::string& message);
void set_race_thrower(RaceThrower thrower);
// What a device index out of range throws (c10::ValueError), unless the bindings install a thrower
// of their own: they throw torch_pipeline.sim.DeviceIndexError, both a ValueError and a
// RuntimeError (CUDA raises RuntimeError for an invalid device ordinal, and programs catch that).
void set_device_index_thrower(RaceThrower thrower);

// Note [Race reports with sites]: while sites are on, every recorded op keeps where it was called
// from (the bindings' gatherer: the calling thread's Python stack), so a race names the code of
// both accesses, and a race's memory names the tensor's dtype and shape. Off by default: a
// gather costs more than the op it describes. The gatherer runs on the op's thread before the
// checker's lock is taken, with no sim lock held; it returns null where there is nothing to
// gather (a thread that never ran Python).
using SiteGatherer = Site (*)();
void set_site_gatherer(SiteGatherer gatherer);
void set_record_sites(bool on);
bool record_sites();

}  // namespace sim
}  // namespace torch_pipeline
