// Internal to the tracker. The storage table module: binds core::StorageTable to c10 storages
// (entries, young outputs, sweep of dead ones, which the core tracker then forgets). Touches
// LiveState::storages and, for dead entries, LiveState::tracker and g_host_watch. Callers hold
// LiveState::mutex.
#pragma once

#include "state.h"

#include <c10/core/Storage.h>

#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// The entry of `storage`, created if it has none (a young one is promoted).
StorageEntry& acquire_storage_locked(LiveState& st, const c10::Storage& storage);
// The entry of a live storage (a young one is promoted); nullptr if it has none.
StorageEntry* find_storage_locked(LiveState& st, const c10::StorageImpl* key);
// A fresh output of the op at `definition` (young until used again).
void add_young_locked(LiveState& st, const c10::Storage& storage, Position definition);
// A storage of unknown origin first used on `stream` (recorded there with the allocator): young,
// home there, with no definition (Note [Storages of unknown origin]). Returns its young slot (a
// hint for StorageTable::note_home_use).
size_t adopt_storage_locked(LiveState& st, const c10::Storage& storage, StreamId stream);
// Tells the core tracker about a pending definition (and the home-stream uses noted since) before
// the storage's next use elsewhere.
void define_pending_locked(LiveState& st, StorageEntry& e);
// The table's sweep dropped these (their storages died): the tracker forgets them.
void forget_dead_locked(LiveState& st, std::vector<StorageEntry>& dead);

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
