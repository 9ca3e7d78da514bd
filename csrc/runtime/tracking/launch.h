// Internal to the tracker. The launch module: the path an op (observer.*) or a tp.track scope
// (track_scope.cpp) takes on the device side: before it, one core-tracker launch per device on
// that device's current stream, with the waits it returns inserted; after it, the position
// settles, fresh outputs get their (pending) definition, keep-alives start, and the thread's run
// on a stream gets its event when it leaves the stream. Owns the per-thread run state (ThreadRun);
// touches the stream log, storage table, keep-alive and host-watch modules through their headers.
#pragma once

#include "state.h"

#include <c10/core/Device.h>

#include <memory>
#include <optional>
#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// Per-thread state of the launch path.
struct ThreadRun {
  // The position of this thread's last launch, if its event is not recorded yet (recorded when
  // the thread launches on another stream: the end of its run of ops on that stream).
  Position last;
  uint64_t last_period = 0;
  // Storages of other streams the op uses (allocator safety), kept alive from its end on.
  std::vector<PendingKeepAlive> keep_alive;
  // Scratch space.
  std::vector<StorageId> reads, writes;
  std::vector<c10::Device> devices;
  std::vector<std::shared_ptr<c10::Event>> wait_events;  // the events a launch waits on
  // Accesses of a launch to storages whose state is all pending on its stream, noted after it
  // (Note [Home-stream uses]): the storage, its entry (null: young), its young slot as the lookup
  // or the adoption left it (a hint) and whether it is written.
  struct HomeUse {
    const c10::StorageImpl* key;
    StorageEntry* entry;
    size_t young_slot;
    bool write;
  };
  std::vector<HomeUse> home_uses;
};
ThreadRun& thread_run();

// Launches `accesses` (device tensors; with `async` also the CPU tensors of a non_blocking copy)
// on the current streams of their devices, waits inserted; appends to `launched` and sets
// `period`. `target`: the device of a non_blocking copy from the host (launched first).
void device_launch(ThreadRun& run, const std::vector<Access>& accesses, bool async,
                   std::vector<Launched>& launched, uint64_t& period,
                   std::optional<c10::Device> target = std::nullopt);
// Before a factory (an op with no input on a device) runs on `devices`: their current streams are
// known to this period, so a stream seen for the first time waits for the go-live baseline now,
// before the factory allocates (maybe a block that untracked work before the period still uses)
// and writes, not after it (its launch is registered at its end).
void enter_streams(const std::vector<c10::Device>& devices);
// The launches of `launched` have finished launching (when the op failed before its end).
void settle(const std::vector<Launched>& launched, uint64_t period);
// After the op: `fresh` outputs (may be null) get it as their pending definition (a factory's
// device gets a launch appended to `launched`), keep-alives start, and the run's event is recorded
// where due. `moved` (may be null): inputs whose storage the op reallocated (resize_); their new
// memory was allocated on the op's stream of their device, their new home. period 0: the current
// period (nothing was launched before).
void finish(ThreadRun& run, std::vector<Launched>& launched, uint64_t period,
            const std::vector<at::Tensor>* fresh, bool async,
            const std::vector<at::Tensor>* moved = nullptr);

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
