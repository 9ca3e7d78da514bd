// The tracker's storage table (core/storage_table.h): young outputs, promotion, and the amortised
// sweep that keeps the table O(live storages).
#include "core/storage_table.h"

#include <gtest/gtest.h>

#include <deque>
#include <memory>
#include <vector>

using torch_pipeline::core::Position;
using torch_pipeline::core::StorageId;
using torch_pipeline::core::StorageTable;

namespace {

// A storage: alive while `owner` is; the table holds a weak reference.
struct Storage {
  std::shared_ptr<int> owner = std::make_shared<int>(0);
  const int* key() const { return owner.get(); }
  std::weak_ptr<int> ref() const { return owner; }
};
struct Data {
  int tag = 0;
};
using Table = StorageTable<const int*, std::weak_ptr<int>, Data>;

}  // namespace

TEST(StorageTable, YoungOutputsCostNoEntryUntilUsedAgain) {
  Table table(nullptr, /*young_capacity=*/4);
  Storage s;
  table.add_young(s.key(), [&] { return s.ref(); }, Position{3, 7});
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.young(), 1u);
  Table::Entry* e = table.find(s.key());  // promoted
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(table.size(), 1u);
  EXPECT_EQ(table.young(), 0u);
  EXPECT_EQ(e->pending_definition, (Position{3, 7}));
  EXPECT_EQ(e->home, 3);
  EXPECT_TRUE(e->recorded.contains(3));
  EXPECT_EQ(e->id, Table::id_of(s.key()));
}

TEST(StorageTable, AnUnseenOutputIsAddedWithoutLookupsAndBehavesAsAnyYoungOne) {
  // `unseen`: the caller knows the table holds no reference to the key (the runtime reads it off
  // the StorageImpl's weak count); the output is young as after a full add_young.
  Table table(nullptr, /*young_capacity=*/2);
  Storage s, t, u;
  EXPECT_EQ(table.add_young(s.key(), [&] { return s.ref(); }, Position{3, 7}, /*unseen=*/true), 0u);
  EXPECT_EQ(table.young(), 1u);
  EXPECT_EQ(table.pending_home(s.key()), 3);
  table.note_home_use(s.key(), 8, /*write=*/true);
  // Two more unseen outputs: `s` leaves the ring, promoted with its definition and home use.
  table.add_young(t.key(), [&] { return t.ref(); }, Position{3, 9}, /*unseen=*/true);
  table.add_young(u.key(), [&] { return u.ref(); }, Position{3, 10}, /*unseen=*/true);
  EXPECT_EQ(table.young(), 2u);
  EXPECT_EQ(table.size(), 1u);
  Table::Entry* e = table.find(s.key());
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->pending_definition, (Position{3, 7}));
  EXPECT_EQ(e->home_uses.write, 8u);
}

TEST(StorageTable, TheRingPromotesOnlyLiveStoragesThatLeaveIt) {
  Table table(nullptr, /*young_capacity=*/2);
  Storage kept;
  table.add_young(kept.key(), [&] { return kept.ref(); }, Position{1, 1});
  {
    Storage dies;
    table.add_young(dies.key(), [&] { return dies.ref(); }, Position{1, 2});
  }
  Storage a, b;
  table.add_young(a.key(), [&] { return a.ref(); }, Position{1, 3});  // `kept` leaves: promoted
  table.add_young(b.key(), [&] { return b.ref(); }, Position{1, 4});  // `dies` leaves: dropped
  EXPECT_EQ(table.size(), 1u);
  ASSERT_NE(table.find(kept.key()), nullptr);
}

TEST(StorageTable, HomeUsesStayPendingUntilTheEntryIsTold) {
  // Note [Home-stream uses]: a young storage, and an entry with a pending definition on its home
  // stream, have a pending home; their uses there are noted (the latest write, the latest read
  // after it) and carried into the entry on promotion; a redefinition drops them.
  Table table(nullptr, /*young_capacity=*/4);
  Storage s, other;
  EXPECT_EQ(table.pending_home(s.key()), 0);
  table.add_young(s.key(), [&] { return s.ref(); }, Position{3, 7});
  EXPECT_EQ(table.pending_home(s.key()), 3);
  table.note_home_use(s.key(), 8, /*write=*/false);
  table.note_home_use(s.key(), 9, /*write=*/true);  // drops the read before it
  table.note_home_use(s.key(), 10, /*write=*/false);
  table.note_home_use(s.key(), 11, /*write=*/false);
  EXPECT_EQ(table.size(), 0u);  // (no promotion)
  Table::Entry* e = table.find(s.key());
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->home_uses.write, 9u);
  EXPECT_EQ(e->home_uses.read, 11u);
  EXPECT_EQ(table.pending_home(s.key()), 3);         // an entry whose definition is still pending
  table.note_home_use(s.key(), 12, /*write=*/true);  // an op reading and writing it: written
  table.note_home_use(s.key(), 12, /*write=*/false);
  EXPECT_EQ(e->home_uses.write, 12u);
  EXPECT_EQ(e->home_uses.read, 0u);
  e->moved_to(5);  // a new home: its state is no longer all pending there
  EXPECT_EQ(table.pending_home(s.key()), 0);
  table.add_young(s.key(), [&] { return s.ref(); }, Position{5, 2});  // redefined
  EXPECT_EQ(e->home_uses.write, 0u);
  EXPECT_EQ(table.pending_home(s.key()), 5);
  e->pending_definition = Position{};  // told to the tracker
  EXPECT_EQ(table.pending_home(s.key()), 0);
  table.add_young(other.key(), [&] { return other.ref(); }, Position{1, 1});
  table.note_home_use(other.key(), 2, /*write=*/false);
  table.add_young(other.key(), [&] { return other.ref(); }, Position{1, 3});  // young, redefined
  EXPECT_EQ(table.find(other.key())->home_uses.read, 0u);
}

TEST(StorageTable, AYoungSlotHintIsUsedOnlyWhileItsSlotHoldsTheStorage) {
  // The launch notes a home use after the launch with the slot its lookup found: a storage added
  // to the ring in between may have taken that slot (promoting the one looked up), and the use
  // must still reach the right storage.
  Table table(nullptr, /*young_capacity=*/1);
  Storage s, t;
  const size_t slot = table.add_young(s.key(), [&] { return s.ref(); }, Position{3, 7});
  torch_pipeline::core::StreamId pending = 0;
  size_t found_slot = Table::kNoSlot;
  EXPECT_EQ(table.lookup(s.key(), &pending, &found_slot), nullptr);
  EXPECT_EQ(found_slot, slot);
  EXPECT_EQ(pending, 3);
  table.note_home_use(s.key(), 8, /*write=*/false, found_slot);  // the slot still holds it
  // `t` takes the only slot: `s` is promoted, with its noted use.
  EXPECT_EQ(table.adopt(t.key(), [&] { return t.ref(); }, /*stream=*/3), slot);
  Table::Entry* e = table.find(s.key());
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->home_uses.read, 8u);
  table.note_home_use(s.key(), 9, /*write=*/true, found_slot);  // stale: looked up again
  EXPECT_EQ(e->home_uses.write, 9u);
  EXPECT_EQ(table.find(t.key())->home_uses.write, 0u);  // (not given s's use)
  EXPECT_EQ(table.lookup(s.key(), &pending, &found_slot), e);
  EXPECT_EQ(found_slot, Table::kNoSlot);
}

TEST(StorageTable, AnAdoptedStorageIsHomeWhereAdoptedWithNoDefinition) {
  // Note [Storages of unknown origin]: adopted by stream 4, young with no definition (seq 0);
  // its uses there are noted, and promotion keeps them with the stream as its home.
  Table table(nullptr, /*young_capacity=*/4);
  Storage s;
  table.adopt(s.key(), [&] { return s.ref(); }, /*stream=*/4);
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.pending_home(s.key()), 4);
  table.note_home_use(s.key(), 6, /*write=*/false);
  Table::Entry* e = table.find(s.key());  // promoted
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->pending_definition, (Position{4, 0}));
  EXPECT_EQ(e->home, 4);
  EXPECT_TRUE(e->recorded.contains(4));
  EXPECT_EQ(e->home_uses.read, 6u);
  EXPECT_EQ(e->home_uses.write, 0u);
  EXPECT_EQ(table.pending_home(s.key()), 4);  // (its state is still all pending there)
  table.note_home_use(s.key(), 7, /*write=*/true);
  EXPECT_EQ(e->home_uses.write, 7u);
}

TEST(StorageTable, AcquireCreatesOnceAndRedefinitionResetsTheEntry) {
  Table table(nullptr);
  Storage s;
  int made = 0;
  auto make = [&] {
    ++made;
    return s.ref();
  };
  Table::Entry& e = table.acquire(s.key(), make);
  e.data.tag = 5;
  e.recorded.add(9);
  EXPECT_EQ(&table.acquire(s.key(), make), &e);
  EXPECT_EQ(made, 1);
  table.add_young(s.key(), make, Position{2, 4});  // an output of a storage known already
  EXPECT_EQ(table.young(), 0u);
  EXPECT_EQ(e.pending_definition, (Position{2, 4}));
  EXPECT_FALSE(e.recorded.contains(9));
  EXPECT_EQ(e.data.tag, 5);
}

TEST(StorageTable, FindSkipsDeadStorages) {
  Table table(nullptr);
  const int* key;
  {
    Storage s;
    key = s.key();
    table.acquire(key, [&] { return s.ref(); });
  }
  EXPECT_EQ(table.find(key), nullptr);
}

// The loop of the sweep bug: a storage made on one stream, used once on another (an entry),
// dropped, over and over, next to one storage that stays alive. The table must stay within a
// constant of the live storages; it grew by one entry per iteration once a sweep had kept one.
TEST(StorageTable, EntriesStayWithinAConstantOfTheLiveStorages) {
  std::vector<StorageId> forgotten;
  Table table([&](std::vector<Table::Entry>& dead) {
    for (const auto& e : dead) forgotten.push_back(e.id);
  });
  Storage x;
  table.acquire(x.key(), [&] { return x.ref(); });
  size_t most = 0;
  for (int i = 0; i < 20000; ++i) {
    Storage y;
    table.add_young(y.key(), [&] { return y.ref(); }, Position{2, uint64_t(i) + 1});
    ASSERT_NE(table.find(y.key()), nullptr);  // used again: promoted
    most = std::max(most, table.size());
  }
  EXPECT_LE(most, 2 * Table::kMinSweep + 2) << "sweeps: " << table.sweeps();
  EXPECT_GE(table.sweeps(), 20000 / (Table::kMinSweep + 1));
  EXPECT_GT(forgotten.size(), 18000u);
  EXPECT_NE(table.find(x.key()), nullptr);
}

TEST(StorageTable, SweepsScaleWithManyLiveStorages) {
  Table table(nullptr, Table::kYoung, /*min_sweep=*/16);
  std::deque<Storage> live(100);
  for (auto& s : live) {
    table.acquire(s.key(), [&] { return s.ref(); });
  }
  for (int i = 0; i < 5000; ++i) {
    Storage y;
    table.acquire(y.key(), [&] { return y.ref(); });
    EXPECT_LE(table.size(), 2 * live.size() + 16 + 1);
  }
  size_t alive = 0;
  table.for_each_alive([&](Table::Entry&) { ++alive; });
  EXPECT_EQ(alive, live.size());
}

// The ring's buckets (which let a lookup of a key that is not young skip the scan) never hide a
// young key: over many adds, promotions and deaths, with more keys than buckets (so keys share
// buckets), pending_home answers what a plain scan of the ring would.
TEST(StorageTable, EveryYoungKeyIsFoundWhateverItsBucket) {
  constexpr size_t kCapacity = 200;  // (more than the buckets: some hold several keys)
  Table table(nullptr, kCapacity);
  std::deque<Storage> alive;
  // The model: the keys of the latest kCapacity adds that were not used again since (each add
  // takes the slot of the add kCapacity before it), with their add's number and stream.
  struct Young {
    int added;
    const int* key;
    int64_t home;
  };
  std::deque<Young> ring;
  for (int i = 0; i < 5000; ++i) {
    alive.emplace_back();
    Storage& s = alive.back();
    const int64_t stream = 1 + i % 7;
    table.add_young(s.key(), [&] { return s.ref(); }, Position{stream, uint64_t(i) + 1});
    ring.push_back(Young{i, s.key(), stream});
    while (ring.front().added + static_cast<int>(kCapacity) <= i) {
      ring.pop_front();  // its slot was taken
    }
    if (i % 3 == 0) {  // used again: promoted, no longer young
      const auto [added, key, home] = ring[ring.size() / 2];
      ASSERT_EQ(table.pending_home(key), home) << "a young key was not found (step " << i << ")";
      ASSERT_NE(table.find(key), nullptr);
      ring.erase(ring.begin() + static_cast<std::ptrdiff_t>(ring.size() / 2));
      ASSERT_EQ(table.pending_home(key), home);  // (the entry's pending definition now)
    }
    if (alive.size() > 300) {
      alive.pop_front();  // its storage dies; a key still in the ring keeps its slot
    }
    ASSERT_EQ(table.young(), ring.size()) << "step " << i;
    for (const auto& [added, key, home] : ring) {
      ASSERT_EQ(table.pending_home(key), home) << "step " << i;
    }
  }
  Storage never;
  EXPECT_EQ(table.pending_home(never.key()), 0);
}
