#include "core/slot_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using torch_pipeline::core::SlotAllocator;

TEST(SlotAllocator, HandsOutSmallestFreeSlotFirst) {
  SlotAllocator slots;
  EXPECT_EQ(slots.acquire(), 0);
  EXPECT_EQ(slots.acquire(), 1);
  EXPECT_EQ(slots.acquire(), 2);
  EXPECT_EQ(slots.acquire(), 3);
  slots.release(2);
  slots.release(0);
  // Both 0 and 2 are free: the smaller one goes first, then the other, then a fresh one.
  EXPECT_EQ(slots.acquire(), 0);
  EXPECT_EQ(slots.acquire(), 2);
  EXPECT_EQ(slots.acquire(), 4);
}

TEST(SlotAllocator, StartsAtFirst) {
  SlotAllocator slots(1);
  EXPECT_EQ(slots.high_water(), 1);
  EXPECT_EQ(slots.num_held(), 0);
  EXPECT_FALSE(slots.is_held(0));
  EXPECT_EQ(slots.acquire(), 1);
  EXPECT_EQ(slots.acquire(), 2);
  EXPECT_TRUE(slots.is_held(1));
  EXPECT_FALSE(slots.is_held(0));
}

TEST(SlotAllocator, ReusesSlotAfterRelease) {
  SlotAllocator slots(1);
  // Pipelines whose lifetimes do not overlap get the same slot.
  for (int i = 0; i < 10; ++i) {
    const int64_t slot = slots.acquire();
    EXPECT_EQ(slot, 1);
    EXPECT_TRUE(slots.is_held(slot));
    slots.release(slot);
    EXPECT_FALSE(slots.is_held(slot));
  }
  EXPECT_EQ(slots.high_water(), 2);
}

TEST(SlotAllocator, SlotsAreDistinctWhileHeld) {
  SlotAllocator slots;
  std::set<int64_t> held;
  for (int i = 0; i < 100; ++i) {
    const int64_t slot = slots.acquire();
    EXPECT_TRUE(held.insert(slot).second) << "slot " << slot << " handed out twice";
  }
  EXPECT_EQ(slots.num_held(), 100);
  for (int64_t slot : held) EXPECT_TRUE(slots.is_held(slot));
  // Release every other one and take them again: still no duplicates among the held slots.
  for (int64_t slot = 0; slot < 100; slot += 2) {
    slots.release(slot);
    held.erase(slot);
  }
  EXPECT_EQ(slots.num_held(), 50);
  for (int i = 0; i < 50; ++i) {
    const int64_t slot = slots.acquire();
    EXPECT_TRUE(held.insert(slot).second) << "slot " << slot << " handed out twice";
  }
  EXPECT_EQ(slots.num_held(), 100);
  EXPECT_EQ(slots.high_water(), 100);
}

TEST(SlotAllocator, ReleaseOfSlotNotHeldThrows) {
  SlotAllocator slots(1);
  const int64_t a = slots.acquire();  // 1
  const int64_t b = slots.acquire();  // 2

  // Never handed out, and below `first`.
  for (int64_t bad : {int64_t{7}, int64_t{0}, int64_t{-3}}) {
    try {
      slots.release(bad);
      ADD_FAILURE() << "release(" << bad << ") did not throw";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("slot " + std::to_string(bad)), std::string::npos)
          << e.what();
    }
  }

  // Double release.
  slots.release(a);
  EXPECT_THROW(slots.release(a), std::logic_error);

  // A failed release changes nothing.
  EXPECT_EQ(slots.num_held(), 1);
  EXPECT_TRUE(slots.is_held(b));
  EXPECT_EQ(slots.acquire(), a);
  EXPECT_EQ(slots.acquire(), 3);
}

TEST(SlotAllocator, HighWaterIsOnePastLargestEverHandedOut) {
  SlotAllocator slots(1);
  EXPECT_EQ(slots.high_water(), 1);
  const int64_t a = slots.acquire();
  const int64_t b = slots.acquire();
  const int64_t c = slots.acquire();
  EXPECT_EQ(slots.high_water(), 4);
  slots.release(c);
  slots.release(b);
  slots.release(a);
  // Releasing does not lower it...
  EXPECT_EQ(slots.high_water(), 4);
  EXPECT_EQ(slots.num_held(), 0);
  // ...and reusing released slots does not raise it.
  slots.acquire();
  slots.acquire();
  slots.acquire();
  EXPECT_EQ(slots.high_water(), 4);
  slots.acquire();
  EXPECT_EQ(slots.high_water(), 5);
  EXPECT_EQ(slots.num_held(), 4);
}

TEST(SlotAllocator, ConcurrentAcquireReleaseNeverSharesASlot) {
  constexpr int kThreads = 8;
  constexpr int kHeldPerThread = 3;
  constexpr int kIterations = 20000;
  // Smallest-free-first means no more than kThreads * kHeldPerThread slots are ever needed.
  constexpr int kMaxSlots = kThreads * kHeldPerThread;

  SlotAllocator slots;
  std::vector<std::atomic<int>> occupancy(kMaxSlots + 1);
  std::atomic<int> double_holds{0};
  std::atomic<int> out_of_range{0};

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::vector<int64_t> mine;
      for (int i = 0; i < kIterations; ++i) {
        const bool take = mine.empty() || (mine.size() < kHeldPerThread && (rng() & 1u) != 0u);
        if (take) {
          const int64_t slot = slots.acquire();
          if (slot < 0 || slot >= kMaxSlots) {
            out_of_range.fetch_add(1);
            continue;
          }
          if (occupancy[static_cast<size_t>(slot)].fetch_add(1) != 0) double_holds.fetch_add(1);
          mine.push_back(slot);
        } else {
          const size_t k = rng() % mine.size();
          const int64_t slot = mine[k];
          mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
          occupancy[static_cast<size_t>(slot)].fetch_sub(1);
          slots.release(slot);
        }
      }
      for (int64_t slot : mine) {
        occupancy[static_cast<size_t>(slot)].fetch_sub(1);
        slots.release(slot);
      }
    });
  }
  for (auto& th : threads) th.join();

  EXPECT_EQ(double_holds.load(), 0);
  EXPECT_EQ(out_of_range.load(), 0);
  EXPECT_EQ(slots.num_held(), 0);
  EXPECT_LE(slots.high_water(), kMaxSlots);
  for (const auto& o : occupancy) EXPECT_EQ(o.load(), 0);
}
