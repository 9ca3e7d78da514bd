// Plain C++17 (no torch includes). Holds the tracker's per-storage table of one live period: an
// entry per storage with tracked state (keyed by address, kept unique by a weak reference), the
// ring of young storages (fresh outputs that have no entry yet: most die young and never cost
// one), their promotion to entries, and the amortised sweep of entries whose storage died. Touches
// only its members and the on_dead callback it is given; the runtime
// (csrc/runtime/tracking/storages.*) owns one, under its lock, with Key = const c10::StorageImpl*
// and Ref = c10::weak_intrusive_ptr<c10::StorageImpl>. Ref needs `bool expired() const`.
//
// Bound: the sweep runs after as many insertions as there were entries left by the previous one
// (at least min_sweep), so the table holds at most twice the storages alive at the last sweep plus
// min_sweep entries, plus the young ring: O(live storages), however many ops a period runs.
#pragma once

#include "dependency_tracker.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace core {

// A few stream ids, inline (storages are used on one or two streams).
class StreamSet {
 public:
  bool contains(StreamId id) const {
    return std::find(inline_.begin(), inline_.begin() + n_, id) != inline_.begin() + n_ ||
           std::find(more_.begin(), more_.end(), id) != more_.end();
  }
  void add(StreamId id) {
    if (n_ < inline_.size()) {
      inline_[n_++] = id;
    } else {
      more_.push_back(id);
    }
  }
  void reset(StreamId id) {
    n_ = 0;
    more_.clear();
    add(id);
  }

 private:
  std::array<StreamId, 3> inline_{};
  uint8_t n_ = 0;
  std::vector<StreamId> more_;
};

// Note [Home-stream uses]: most storages of a step are made by an op on one stream and used only
// there until they die. Uses on the stream that made a storage need no wait (program order) and
// no allocator protection (it is the allocation stream), so while a storage's definition is still
// pending, its uses on that stream are only noted here (the latest write, the latest read after
// it), not told to the tracker. When anything else needs its state (a use on another stream, a
// resize), the runtime tells the tracker the definition and then these uses
// (DependencyTracker::used): the tracker ends up with the writer and readers it would have had.
struct HomeUses {
  uint64_t write = 0;  // the latest write (seq on the definition's stream; 0: none)
  uint64_t read = 0;   // the latest read after that write (0: none)

  // The op at `seq` of that stream reads or writes it (an op doing both counts as writing).
  void note(uint64_t seq, bool is_write) {
    if (is_write) {
      write = std::max(write, seq);
      read = read > write ? read : 0;
    } else if (seq > write) {
      read = std::max(read, seq);
    }
  }
};

template <typename Key, typename Ref, typename Data>
class StorageTable {
  static_assert(std::is_pointer_v<Key>, "storages are keyed by address");

 public:
  static constexpr size_t kYoung = 64;         // fresh outputs kept without an entry
  static constexpr size_t kMinSweep = 1024;    // insertions between sweeps, at least
  static constexpr size_t kNoSlot = SIZE_MAX;  // (a young slot hint: none)

  struct Entry {
    Entry(Ref r, StorageId i) : ref(std::move(r)), id(i) {}
    Ref ref;             // keeps the address from being reused while the entry exists
    StorageId id;        // the address
    StreamId home = 0;   // the stream it was allocated on, if known (made by an op)
    StreamSet recorded;  // streams recorded with the allocator (record_stream)
    // Created by the op at this position (a fresh output), not yet told to the tracker: many
    // outputs are never used again, so the definition waits for the storage's next use. seq 0 on
    // a stream: adopted there, no definition (Note [Storages of unknown origin]); stream 0: none.
    Position pending_definition;
    // Uses on the stream of pending_definition since then, not told to the tracker either
    // (Note [Home-stream uses]): the latest write and the latest read after it (seqs, 0: none).
    HomeUses home_uses;
    Data data;  // the runtime's own fields

    // A fresh output of the op at `p`, allocated on its stream.
    void define(Position p) {
      pending_definition = p;
      home_uses = HomeUses{};
      moved_to(p.stream);
    }
    // Its memory was reallocated on `stream` (resize_): the new block's allocation stream, which
    // no stream has been recorded on yet. Its accesses stay as they were.
    void moved_to(StreamId stream) {
      recorded.reset(stream);
      home = stream;
    }
  };
  // Receives the entries a sweep dropped (their storages died).
  using OnDead = std::function<void(std::vector<Entry>& dead)>;

  explicit StorageTable(OnDead on_dead, size_t young_capacity = kYoung,
                        size_t min_sweep = kMinSweep)
      : on_dead_(std::move(on_dead)),
        young_capacity_(std::max<size_t>(1, young_capacity)),
        min_sweep_(std::max<size_t>(1, min_sweep)),
        young_(young_capacity_),
        young_keys_(young_capacity_, nullptr) {}

  static StorageId id_of(Key key) { return reinterpret_cast<StorageId>(key); }

  // The entry of `key` whose storage is alive (a young one is promoted); nullptr if none.
  Entry* find(Key key) {
    auto it = map_.find(key);
    Entry* e = it != map_.end() ? &it->second : promote_young(key);
    return e == nullptr || e->ref.expired() ? nullptr : e;
  }

  // The entry of `key`, created (with make_ref()) if it has none: a young one is promoted.
  template <typename MakeRef>
  Entry& acquire(Key key, MakeRef&& make_ref) {
    auto it = map_.find(key);
    if (it != map_.end()) {
      return it->second;
    }
    if (Entry* e = promote_young(key)) {
      return *e;
    }
    return insert(key, make_ref());
  }

  // The stream of `key`'s pending definition, while its state is still all pending (a young
  // storage, or an entry with a pending definition on its home stream), else 0; no promotion.
  // Note [Home-stream uses].
  StreamId pending_home(Key key) {
    StreamId home = 0;
    lookup(key, &home);
    return home;
  }
  // One lookup for both paths: `key`'s entry if it has one (no promotion; nullptr if none), and
  // in `*pending_home` what pending_home(key) returns; in `*young_slot` (if given) its slot in the
  // young ring, kNoSlot if it is not young: a hint for note_home_use.
  Entry* lookup(Key key, StreamId* pending_home, size_t* young_slot = nullptr) {
    const auto it = map_.find(key);  // (first: most storages an op reads have entries)
    if (it != map_.end()) {
      Entry& e = it->second;
      *pending_home =
          e.pending_definition.stream != 0 && e.home == e.pending_definition.stream ? e.home : 0;
      if (young_slot != nullptr) {
        *young_slot = kNoSlot;
      }
      return &e;
    }
    const size_t y = young_index(key);
    const bool young = y != young_keys_.size();
    *pending_home = young ? young_[y]->definition.stream : 0;
    if (young_slot != nullptr) {
      *young_slot = young ? y : kNoSlot;
    }
    return nullptr;
  }
  // The op at `seq` on pending_home(key) (not 0) reads or writes it: noted with the pending state.
  // `young_slot` is a hint from lookup() or add_young(), used only while that slot still holds
  // `key` (a storage added to the ring since may have taken it; then `key` is looked up again).
  void note_home_use(Key key, uint64_t seq, bool write, size_t young_slot = kNoSlot) {
    if (young_slot < young_keys_.size() && young_keys_[young_slot] == key) {
      young_[young_slot]->home_uses.note(seq, write);
      return;
    }
    const auto it = map_.find(key);
    if (it != map_.end()) {
      it->second.home_uses.note(seq, write);
      return;
    }
    const size_t y = young_index(key);
    if (y != young_keys_.size()) {
      young_[y]->home_uses.note(seq, write);
    }
  }

  // `key` is a fresh output of the op at `definition`: it stays young (no entry) until it is used
  // again or the ring is full; an entry it has already is redefined. Returns its young slot
  // (kNoSlot: it has an entry). `unseen`: the caller knows the table holds no reference to `key`
  // (no entry, not young), so neither is looked up.
  template <typename MakeRef>
  size_t add_young(Key key, MakeRef&& make_ref, Position definition, bool unseen = false) {
    if (!unseen) {
      auto it = map_.find(key);
      if (it != map_.end()) {
        it->second.define(definition);  // (an output of a storage known already)
        return kNoSlot;
      }
      if (const size_t i = young_index(key); i != young_keys_.size()) {
        Young& y = *young_[i];
        y.definition = definition;  // (two outputs sharing a storage, or an op returning it again)
        y.home_uses = HomeUses{};
        return i;
      }
    }
    // The slot of the oldest young storage (or an empty one): promoted if it is still alive.
    const size_t slot = young_next_;
    young_next_ = (young_next_ + 1) % young_capacity_;
    if (young_keys_[slot] != nullptr) {
      Young oldest = std::move(*young_[slot]);
      release_young(slot);
      if (!oldest.ref.expired()) {
        promote(std::move(oldest));
      }
    }
    young_[slot].emplace(Young{key, make_ref(), definition, HomeUses{}});
    set_young_key(slot, key);
    ++young_size_;
    return slot;
  }

  // Note [Storages of unknown origin]: a storage the period has not seen (made before tracking
  // went live, or inside an observed op without being its output: the statistics batch norm saves
  // for backward) has no known allocation stream and no known writer. The first stream that uses
  // it records it with the allocator, which then keeps the block from reuse until that stream's
  // work at free time is done, as it would on the allocation stream: from then on the storage is
  // home there. So it is adopted as a young storage of that stream with no definition (seq 0), its
  // uses there noted like those of a fresh output (Note [Home-stream uses]), and it costs an entry
  // only if another stream uses it or it outlives the ring. (No writer is invented: a later
  // reader on another stream waits for nothing but the noted uses.)
  // Returns its young slot, as add_young().
  template <typename MakeRef>
  size_t adopt(Key key, MakeRef&& make_ref, StreamId stream) {
    return add_young(key, std::forward<MakeRef>(make_ref), Position{stream, 0});
  }

  // f(Entry&) for every entry whose storage is alive.
  template <typename F>
  void for_each_alive(F&& f) {
    for (auto& [key, e] : map_) {
      if (!e.ref.expired()) {
        f(e);
      }
    }
  }

  size_t size() const { return map_.size(); }   // entries (some may be dead, until a sweep)
  size_t young() const { return young_size_; }  // young storages
  size_t sweeps() const { return sweeps_; }

  // Drops every entry and young storage (on_dead is not called).
  void clear() {
    map_.clear();
    for (size_t i = 0; i < young_capacity_; ++i) {
      if (young_keys_[i] != nullptr) {
        release_young(i);
      }
    }
    young_next_ = 0;
    inserted_since_sweep_ = 0;
    left_by_sweep_ = 0;
  }

  // Drops the entries of dead storages now (on_dead gets them).
  void sweep() {
    ++sweeps_;
    inserted_since_sweep_ = 0;
    std::vector<Entry> dead;
    dead.reserve(map_.size());  // (entries are large: moved once, not again at each growth)
    for (auto it = map_.begin(); it != map_.end();) {
      if (it->second.ref.expired()) {
        dead.push_back(std::move(it->second));
        it = map_.erase(it);
      } else {
        ++it;
      }
    }
    // The next sweep after as many insertions as entries are left (at least min_sweep_): the cost
    // of a sweep is amortised over the insertions that made it due.
    left_by_sweep_ = map_.size();
    if (!dead.empty() && on_dead_) {
      on_dead_(dead);
    }
  }

 private:
  struct Young {
    Key key;
    Ref ref;
    Position definition;
    HomeUses home_uses;
  };

  // The slot of `key` in the young ring, young_keys_.size() if it is not young. A key whose
  // bucket counts no young key is answered without scanning the ring (a fresh output's address,
  // a storage that has an entry): the scan is about two instructions per slot.
  size_t young_index(Key key) const {
    if (young_buckets_[bucket_of(key)] == 0) {
      return young_keys_.size();
    }
    return static_cast<size_t>(std::find(young_keys_.begin(), young_keys_.end(), key) -
                               young_keys_.begin());
  }
  static size_t bucket_of(Key key) {
    const auto a = reinterpret_cast<uintptr_t>(key);
    return static_cast<size_t>((a >> 4) ^ (a >> 10)) % kYoungBuckets;  // (16-byte aligned)
  }
  void set_young_key(size_t slot, Key key) {
    young_keys_[slot] = key;
    ++young_buckets_[bucket_of(key)];
  }
  void release_young(size_t slot) {
    --young_buckets_[bucket_of(young_keys_[slot])];
    young_[slot].reset();
    young_keys_[slot] = nullptr;
    --young_size_;
  }

  Entry& insert(Key key, Ref ref) {
    if (++inserted_since_sweep_ >= std::max(min_sweep_, left_by_sweep_)) {
      sweep();
    }
    return map_.emplace(key, Entry(std::move(ref), id_of(key))).first->second;
  }
  // Gives a young storage its entry (defined by its op, allocated on that op's stream).
  Entry& promote(Young&& y) {
    Entry& e = insert(y.key, std::move(y.ref));  // (new: young storages have no entry)
    e.define(y.definition);
    e.home_uses = y.home_uses;
    return e;
  }
  Entry* promote_young(Key key) {
    const size_t i = young_index(key);
    if (i == young_keys_.size()) {
      return nullptr;
    }
    Young y = std::move(*young_[i]);
    release_young(i);
    return &promote(std::move(y));
  }

  OnDead on_dead_;
  const size_t young_capacity_;
  const size_t min_sweep_;
  std::unordered_map<Key, Entry> map_;
  // The young ring: the latest young_capacity_ fresh outputs, one slot each, reused in turn
  // (young_next_ is the oldest); a slot is empty (its key nullptr) once its storage got an
  // entry. The lookups scan the keys (a few cache lines), not the records.
  std::vector<std::optional<Young>> young_;
  std::vector<Key> young_keys_;
  // How many young keys hash to each bucket (bucket_of): most lookups of a key that is not young
  // stop here.
  static constexpr size_t kYoungBuckets = 512;  // (a full ring of 64 fills about 12%)
  std::array<uint32_t, kYoungBuckets> young_buckets_{};
  size_t young_next_ = 0;
  size_t young_size_ = 0;
  size_t inserted_since_sweep_ = 0;
  size_t left_by_sweep_ = 0;  // entries the last sweep left
  size_t sweeps_ = 0;
};

}  // namespace core
}  // namespace torch_pipeline
