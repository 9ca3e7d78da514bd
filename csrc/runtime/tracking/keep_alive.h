// Internal to the tracker. The keep-alive module: allocator safety (docs/design.md, "The rules")
// for storages used off their allocation stream, by keeping them alive until the use completes (per
// stream in LiveState::kept, polled) or by the allocator's record_stream. Changes LiveState::kept
// through its methods and the storage entries' `recorded` set, and records events on streams
// (through streams.h). Callers of *_locked hold LiveState::mutex.
#pragma once

#include "state.h"

#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// The mode now (TORCH_PIPELINE_ALLOCATOR_SAFETY is read on the first call).
bool keeping_alive();

// The op about to launch on `se` uses storage `e`: keep it alive from the op's end (appended to
// `pending`) or record it with the allocator, as the mode and its allocation stream say.
void protect_use_locked(StorageEntry& e, StreamEntry& se, const c10::Storage& storage,
                        bool keep_alive, std::vector<PendingKeepAlive>& pending);
// A storage of unknown allocation stream (no entry, not young) that the op about to launch on
// `se` uses first: recorded on `se` with the allocator, which then treats `se` as if it were the
// allocation stream (Note [Storages of unknown origin]).
void adopt_locked(const StreamEntry& se, const c10::Storage& storage);
// The op about to launch on `se` writes storage `e` and may give it new memory (resize_, an out=
// argument): its block as it is now is freed inside the op, to the pool of its allocation stream,
// where the next allocation may take it at once. Unless `se` is that stream, the block is recorded
// on `se` with the allocator (in both modes: keeping the storage alive does not keep its old
// block), so it is not reused before this op, and the uses it waits for, have run (once per block
// and stream: StorageEntry::recorded).
void protect_old_block_locked(StorageEntry& e, const StreamEntry& se, const c10::Storage& storage);
// The ops of `launched` have launched: the pending keep-alives on their streams start now.
void start_keep_alive_locked(LiveState& st, std::vector<PendingKeepAlive>& pending,
                             const std::vector<Launched>& launched);
// Keep-alives that cannot start (tracking went idle, the op failed): record_stream instead.
void record_instead(std::vector<PendingKeepAlive>& pending);
// Lets go of storages whose uses are known complete (moved to `released`, to be dropped after the
// lock: dropping the last reference frees memory). Counts a launch; polls when due.
void poll_locked(LiveState& st, std::vector<c10::Storage>& released);
void maybe_poll_locked(LiveState& st, std::vector<c10::Storage>& released);
// Stream `waiter` was just made to wait for `waited` (positions of other streams; a wait the
// tracker inserted, or an external one: a task's future, an event): storages allocated on
// `waiter` and kept alive for a use now ordered before its next ops let go at once (moved to
// `released`). The allocator hands memory out again only to later work of its
// allocation stream, which comes after that wait: e.g. a buffer filled by a copy lane and read on
// its own stream returns to the allocator when its reader frees it, not when a poll sees the copy
// done, however far the host runs ahead.
void release_ordered_locked(LiveState& st, const StreamEntry& waiter,
                            const std::vector<Position>& waited,
                            std::vector<c10::Storage>& released);
// Going idle: storages kept alive, whose uses may still run, go to record_stream (moved to
// `released`).
void hand_to_allocator_locked(LiveState& st, std::vector<c10::Storage>& released);

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
