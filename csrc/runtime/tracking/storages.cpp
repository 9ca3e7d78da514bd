// The storage table module (see storages.h): c10 storages in core::StorageTable, keyed by their
// StorageImpl address and kept unique by a weak reference. Touches LiveState::storages, and
// LiveState::tracker and g_host_watch for dead entries.
#include "storages.h"

namespace torch_pipeline {
namespace tracking {
namespace detail {

StorageEntry& acquire_storage_locked(LiveState& st, const c10::Storage& storage) {
  return st.storages.acquire(storage.unsafeGetStorageImpl(),
                             [&] { return storage.getWeakStorageImpl(); });
}

StorageEntry* find_storage_locked(LiveState& st, const c10::StorageImpl* key) {
  return st.storages.find(key);
}

void add_young_locked(LiveState& st, const c10::Storage& storage, Position definition) {
  // NB: every entry and young storage holds a weak reference to its StorageImpl, so one that has
  // none (a weak count of 1: the count of the strong references) is in neither: most fresh
  // outputs are new storages, whose lookups (a cache miss on the map) are saved. The count is
  // read under the state's lock, under which the table's references are made.
  auto borrowed = c10::intrusive_ptr<c10::StorageImpl>::reclaim(storage.unsafeGetStorageImpl());
  const bool unseen = borrowed.weak_use_count() == 1;
  (void)borrowed.release();  // (borrowed: no reference taken, none dropped)
  st.storages.add_young(
      storage.unsafeGetStorageImpl(), [&] { return storage.getWeakStorageImpl(); }, definition,
      unseen);
}

size_t adopt_storage_locked(LiveState& st, const c10::Storage& storage, StreamId stream) {
  return st.storages.adopt(
      storage.unsafeGetStorageImpl(), [&] { return storage.getWeakStorageImpl(); }, stream);
}

void define_pending_locked(LiveState& st, StorageEntry& e) {
  if (e.pending_definition.stream != 0) {
    // (seq 0: adopted, no definition; Note [Storages of unknown origin])
    if (e.pending_definition.seq != 0) {
      st.tracker->define(e.pending_definition, {e.id});
    }
    // Then its uses on that stream since (Note [Home-stream uses]), oldest first.
    const StreamId home = e.pending_definition.stream;
    if (e.home_uses.write != 0) {
      st.tracker->used(Position{home, e.home_uses.write}, e.id, /*write=*/true);
    }
    if (e.home_uses.read != 0) {
      st.tracker->used(Position{home, e.home_uses.read}, e.id, /*write=*/false);
    }
    e.pending_definition = Position{};
    e.home_uses = core::HomeUses{};
  }
}

void forget_dead_locked(LiveState& st, std::vector<StorageEntry>& dead) {
  std::vector<StorageId> ids;
  ids.reserve(dead.size());
  int64_t watched = 0;
  for (const StorageEntry& e : dead) {
    ids.push_back(e.id);
    watched += e.data.host_watched() ? 1 : 0;
  }
  if (watched != 0) {
    g_host_watch.fetch_sub(watched, std::memory_order_relaxed);
  }
  st.tracker->forget(ids);
}

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
