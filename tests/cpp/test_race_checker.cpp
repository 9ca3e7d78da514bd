#include "core/race_checker.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using torch_pipeline::core::Access;
using torch_pipeline::core::AccessSite;
using torch_pipeline::core::kHost;
using torch_pipeline::core::Race;
using torch_pipeline::core::RaceChecker;
using torch_pipeline::core::Timeline;
using torch_pipeline::core::VectorClock;

namespace {

constexpr uintptr_t kBase = 0x10000;

Access R(uintptr_t begin, uintptr_t end, std::string memory = "mem") {
  return Access{kBase + begin, kBase + end, false, std::move(memory)};
}
Access W(uintptr_t begin, uintptr_t end, std::string memory = "mem") {
  return Access{kBase + begin, kBase + end, true, std::move(memory)};
}

// A checker with streams 1 and 2.
struct Fixture {
  RaceChecker rc;
  Timeline s1 = rc.add_timeline("sim:0 stream 1");
  Timeline s2 = rc.add_timeline("sim:0 stream 2");
};

}  // namespace

TEST(RaceChecker, TimelinesAndLabels) {
  RaceChecker rc;
  EXPECT_EQ(rc.label(kHost), "host");
  EXPECT_EQ(rc.add_timeline("a"), 1);
  EXPECT_EQ(rc.add_timeline("b"), 2);
  EXPECT_EQ(rc.label(1), "a");
  EXPECT_EQ(rc.label(2), "b");
  EXPECT_THROW(rc.label(3), std::out_of_range);
  EXPECT_THROW(rc.record_op(7, "op", {W(0, 4)}), std::out_of_range);
  EXPECT_THROW(rc.snapshot(-1), std::out_of_range);
  EXPECT_THROW(rc.join(5, VectorClock{}), std::out_of_range);
  EXPECT_THROW(rc.join(1, VectorClock(4, 1)), std::invalid_argument);
  EXPECT_THROW(rc.record_op(1, "op", {Access{10, 5, true, "bad"}}), std::invalid_argument);
  EXPECT_EQ(rc.history_size(), 0u);
}

TEST(RaceChecker, SnapshotCountsEpochsAndJoinsHost) {
  Fixture f;
  EXPECT_EQ(f.rc.snapshot(f.s1), (VectorClock{0, 0, 0}));
  f.rc.record_op(f.s1, "a", {W(0, 4)});
  f.rc.record_op(f.s1, "b", {W(0, 4)});
  EXPECT_EQ(f.rc.snapshot(f.s1), (VectorClock{0, 2, 0}));
  f.rc.join_timeline(kHost, f.s1);
  EXPECT_EQ(f.rc.snapshot(kHost), (VectorClock{0, 2, 0}));
  // Joining alone does not start an epoch; the next op on s2 takes the host's clock.
  EXPECT_EQ(f.rc.snapshot(f.s2), (VectorClock{0, 0, 0}));
  f.rc.record_op(f.s2, "c", {R(100, 104)});
  EXPECT_EQ(f.rc.snapshot(f.s2), (VectorClock{0, 2, 1}));
}

TEST(RaceChecker, SameStreamNeverRaces) {
  Fixture f;
  EXPECT_TRUE(f.rc.record_op(f.s1, "w1", {W(0, 64)}).empty());
  EXPECT_TRUE(f.rc.record_op(f.s1, "raw", {R(0, 64)}).empty());   // read after write
  EXPECT_TRUE(f.rc.record_op(f.s1, "war", {W(0, 64)}).empty());   // write after read
  EXPECT_TRUE(f.rc.record_op(f.s1, "waw", {W(16, 32)}).empty());  // write after write
  EXPECT_TRUE(f.rc.races().empty());
}

TEST(RaceChecker, CrossStreamReadAfterWriteWithoutSyncRaces) {
  Fixture f;
  f.rc.record_op(f.s1, "producer", {W(0, 64)});
  const auto races = f.rc.record_op(f.s2, "consumer", {R(0, 64)});
  ASSERT_EQ(races.size(), 1u);
  EXPECT_EQ(races[0].earlier_op, "producer");
  EXPECT_EQ(races[0].earlier_timeline, "sim:0 stream 1");
  EXPECT_TRUE(races[0].earlier_write);
  EXPECT_EQ(races[0].later_op, "consumer");
  EXPECT_EQ(races[0].later_timeline, "sim:0 stream 2");
  EXPECT_FALSE(races[0].later_write);
  EXPECT_EQ(races[0].begin, kBase);
  EXPECT_EQ(races[0].end, kBase + 64);
}

namespace {
struct NamedSite : AccessSite {
  explicit NamedSite(std::string n) : name(std::move(n)) {}
  std::string name;
};
std::string site_name(const torch_pipeline::core::Site& site) {
  const auto* named = dynamic_cast<const NamedSite*>(site.get());
  return named == nullptr ? "" : named->name;
}
}  // namespace

// A race carries the sites of both of its accesses: the earlier one from the history record
// (kept there, and in the parts a partial forget() leaves), the later one from the op.
TEST(RaceChecker, RaceCarriesTheSitesOfBothAccesses) {
  Fixture f;
  f.rc.record_op(f.s1, "producer", {W(0, 64)}, std::make_shared<NamedSite>("producer.py:3"));
  f.rc.forget(kBase + 16, kBase + 32);  // trims the record into [0, 16) and [32, 64)
  auto races =
      f.rc.record_op(f.s2, "consumer", {R(40, 48)}, std::make_shared<NamedSite>("consumer.py:9"));
  ASSERT_EQ(races.size(), 1u);
  EXPECT_EQ(site_name(races[0].earlier_site), "producer.py:3");
  EXPECT_EQ(site_name(races[0].later_site), "consumer.py:9");
  // Without sites, races have none.
  races = f.rc.record_op(f.s1, "other", {W(40, 48)});
  ASSERT_EQ(races.size(), 1u);
  EXPECT_EQ(site_name(races[0].earlier_site), "consumer.py:9");
  EXPECT_EQ(races[0].later_site, nullptr);
}

TEST(RaceChecker, EventOrdersReadAfterWrite) {
  Fixture f;
  f.rc.record_op(f.s1, "producer", {W(0, 64)});
  const VectorClock event = f.rc.snapshot(f.s1);  // event recorded on s1
  f.rc.join(f.s2, event);                         // s2 waits for it
  EXPECT_TRUE(f.rc.record_op(f.s2, "consumer", {R(0, 64)}).empty());
  EXPECT_TRUE(f.rc.races().empty());
}

TEST(RaceChecker, EventRecordedBeforeTheWriteDoesNotOrderIt) {
  Fixture f;
  const VectorClock event = f.rc.snapshot(f.s1);
  f.rc.record_op(f.s1, "producer", {W(0, 64)});
  f.rc.join(f.s2, event);
  EXPECT_EQ(f.rc.record_op(f.s2, "consumer", {R(0, 64)}).size(), 1u);
}

TEST(RaceChecker, HostSyncThenLaterOpOnAnotherStreamIsClean) {
  Fixture f;
  f.rc.record_op(f.s1, "producer", {W(0, 64)});
  f.rc.join_timeline(kHost, f.s1);  // torch.sim stream 1 .synchronize()
  EXPECT_TRUE(f.rc.record_op(f.s2, "consumer", {R(0, 64)}).empty());
  // A write on s1 after the sync is not covered by it.
  f.rc.record_op(f.s1, "producer2", {W(0, 64)});
  EXPECT_EQ(f.rc.record_op(f.s2, "consumer2", {R(0, 64)}).size(), 1u);
}

TEST(RaceChecker, HostEventSyncOrdersLaterOps) {
  Fixture f;
  f.rc.record_op(f.s1, "producer", {W(0, 64)});
  const VectorClock event = f.rc.snapshot(f.s1);
  f.rc.join(kHost, event);  // event.synchronize()
  EXPECT_TRUE(f.rc.record_op(f.s2, "consumer", {R(0, 64)}).empty());
}

TEST(RaceChecker, SyncIsTransitive) {
  RaceChecker rc;
  const Timeline a = rc.add_timeline("a");
  const Timeline b = rc.add_timeline("b");
  const Timeline c = rc.add_timeline("c");
  rc.record_op(a, "w", {W(0, 8)});
  rc.join(b, rc.snapshot(a));
  rc.record_op(b, "mid", {R(100, 108)});
  rc.join(c, rc.snapshot(b));  // c waits for b, which waited for a
  EXPECT_TRUE(rc.record_op(c, "r", {R(0, 8)}).empty());
}

TEST(RaceChecker, WriteAfterReadAcrossStreams) {
  {
    Fixture f;
    f.rc.record_op(f.s1, "reader", {R(0, 64)});
    const auto races = f.rc.record_op(f.s2, "writer", {W(0, 64)});
    ASSERT_EQ(races.size(), 1u);
    EXPECT_FALSE(races[0].earlier_write);
    EXPECT_TRUE(races[0].later_write);
  }
  {
    Fixture f;
    f.rc.record_op(f.s1, "reader", {R(0, 64)});
    f.rc.join(f.s2, f.rc.snapshot(f.s1));
    EXPECT_TRUE(f.rc.record_op(f.s2, "writer", {W(0, 64)}).empty());
  }
}

TEST(RaceChecker, WriteAfterWriteAcrossStreamsRaces) {
  Fixture f;
  f.rc.record_op(f.s1, "w1", {W(0, 64)});
  const auto races = f.rc.record_op(f.s2, "w2", {W(0, 64)});
  ASSERT_EQ(races.size(), 1u);
  EXPECT_TRUE(races[0].earlier_write);
  EXPECT_TRUE(races[0].later_write);
}

TEST(RaceChecker, ReadReadNeverRaces) {
  Fixture f;
  f.rc.record_op(f.s1, "r1", {R(0, 64)});
  EXPECT_TRUE(f.rc.record_op(f.s2, "r2", {R(0, 64)}).empty());
  EXPECT_TRUE(f.rc.record_op(kHost, "r3", {R(0, 64)}).empty());
  EXPECT_TRUE(f.rc.races().empty());
}

TEST(RaceChecker, DisjointRangesNeverRacePartialOverlapsDo) {
  Fixture f;
  f.rc.record_op(f.s1, "w", {W(0, 16)});
  EXPECT_TRUE(f.rc.record_op(f.s2, "adjacent", {W(16, 32)}).empty());
  EXPECT_TRUE(f.rc.record_op(f.s2, "below", {R(0x1000, 0x2000)}).empty());
  const auto races = f.rc.record_op(f.s2, "partial", {R(8, 24)});
  ASSERT_EQ(races.size(), 1u);
  EXPECT_EQ(races[0].earlier_op, "w");
  EXPECT_EQ(races[0].begin, kBase + 8);
  EXPECT_EQ(races[0].end, kBase + 16);
  // An access inside a longer earlier one overlaps it too.
  f.rc.record_op(f.s1, "long", {W(0x100, 0x900)});
  const auto inner = f.rc.record_op(f.s2, "inner", {R(0x400, 0x404)});
  ASSERT_EQ(inner.size(), 1u);
  EXPECT_EQ(inner[0].earlier_op, "long");
  EXPECT_EQ(inner[0].begin, kBase + 0x400);
  EXPECT_EQ(inner[0].end, kBase + 0x404);
}

TEST(RaceChecker, VeryLongRecordsAreFound) {
  Fixture f;
  const uintptr_t top = std::numeric_limits<uintptr_t>::max();
  f.rc.record_op(f.s1, "everything", {Access{0, top, true, "all"}});
  f.rc.record_op(f.s1, "small", {Access{8, 16, true, "small"}});
  const uintptr_t mid = uintptr_t{1} << (std::numeric_limits<uintptr_t>::digits - 1);
  const auto races = f.rc.record_op(f.s2, "probe", {Access{mid, mid + 8, false, "probe"}});
  ASSERT_EQ(races.size(), 1u);
  EXPECT_EQ(races[0].earlier_op, "everything");
  EXPECT_EQ(f.rc.record_op(f.s2, "probe_top", {Access{top - 1, top, false, "t"}}).size(), 1u);
  EXPECT_EQ(f.rc.record_op(f.s2, "probe_low", {Access{8, 9, false, "l"}}).size(), 2u);
}

TEST(RaceChecker, ReuseAsWriteRacesWithUnorderedEarlierRead) {
  {
    Fixture f;
    // A tensor in the first half of a 128-byte block is read on s1; the block is freed and handed
    // to s2, which the allocator reports as a write of the whole block.
    f.rc.record_op(f.s1, "aten::mul.Tensor", {R(0, 64, "old tensor")});
    const auto races = f.rc.record_op(f.s2, "reuse", {W(0, 128, "block")});
    ASSERT_EQ(races.size(), 1u);
    EXPECT_EQ(races[0].earlier_op, "aten::mul.Tensor");
    EXPECT_EQ(races[0].memory, "block");
    EXPECT_EQ(races[0].begin, kBase);
    EXPECT_EQ(races[0].end, kBase + 64);
  }
  {
    Fixture f;
    f.rc.record_op(f.s1, "aten::mul.Tensor", {R(0, 64, "old tensor")});
    f.rc.join(f.s2, f.rc.snapshot(f.s1));  // record_stream: the reuse waits for s1's use
    EXPECT_TRUE(f.rc.record_op(f.s2, "reuse", {W(0, 128, "block")}).empty());
    // The reuse write covers and is ordered after the read, so the read is pruned.
    EXPECT_EQ(f.rc.history_size(), 1u);
  }
}

TEST(RaceChecker, AccessesWithinOneOpNeverRace) {
  Fixture f;
  EXPECT_TRUE(f.rc.record_op(f.s1, "inplace", {R(0, 64), W(0, 64), W(32, 96), R(0, 128)}).empty());
  EXPECT_TRUE(f.rc.races().empty());
  // An in-place op on another stream that reads and writes [0, 16) meets two earlier records there
  // (the write [0, 64) and the read [0, 128)); each pair is reported once, as a write.
  const auto races = f.rc.record_op(f.s2, "aten::add_.Tensor", {R(0, 16), W(0, 16)});
  ASSERT_EQ(races.size(), 2u);
  EXPECT_TRUE(races[0].later_write);
  EXPECT_TRUE(races[1].later_write);
  EXPECT_NE(races[0].earlier_write, races[1].earlier_write);
  for (const Race& race : races) {
    EXPECT_EQ(race.begin, kBase);
    EXPECT_EQ(race.end, kBase + 16);
  }
}

TEST(RaceChecker, RacesAccumulateAndClear) {
  Fixture f;
  f.rc.record_op(f.s1, "w", {W(0, 64)});
  f.rc.record_op(f.s2, "r1", {R(0, 8)});
  f.rc.record_op(f.s2, "r2", {R(8, 16)});
  const auto all = f.rc.races();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].later_op, "r1");
  EXPECT_EQ(all[1].later_op, "r2");
  f.rc.clear_races();
  EXPECT_TRUE(f.rc.races().empty());
  // Clearing reports does not forget history.
  EXPECT_EQ(f.rc.record_op(f.s2, "r3", {R(16, 24)}).size(), 1u);
  EXPECT_EQ(f.rc.races().size(), 1u);
}

TEST(RaceChecker, ToStringNamesOpsTimelinesKindsAndMemory) {
  RaceChecker rc;
  const Timeline s0 = rc.add_timeline("sim:0 stream 0 (default)");
  const Timeline s1 = rc.add_timeline("sim:0 stream 1");
  rc.record_op(s0, "aten::mul.Tensor", {R(0, 16, "sim:0 storage 0x55d0c0 (64 bytes)")});
  const auto races =
      rc.record_op(s1, "aten::add_.Tensor", {W(0, 64, "sim:0 storage 0x55d0c0 (64 bytes)")});
  ASSERT_EQ(races.size(), 1u);
  const std::string text = races[0].to_string();
  EXPECT_EQ(text.find('\n'), std::string::npos);
  for (const char* part :
       {"aten::mul.Tensor", "aten::add_.Tensor", "sim:0 stream 0 (default)", "sim:0 stream 1",
        "sim:0 storage 0x55d0c0 (64 bytes)", "write by", "read by", "0x10000", "0x10010"}) {
    EXPECT_NE(text.find(part), std::string::npos) << "missing '" << part << "' in: " << text;
  }
  // The later op comes first: "write by add_ on stream 1 is not ordered after read by mul ...".
  EXPECT_LT(text.find("write by aten::add_.Tensor on sim:0 stream 1"),
            text.find("read by aten::mul.Tensor on sim:0 stream 0 (default)"));
}

TEST(RaceChecker, ForgetTrimsPartiallyOverlappingRecords) {
  Fixture f;
  f.rc.record_op(f.s1, "w", {W(0, 64)});
  f.rc.forget(kBase + 16, kBase + 32);
  EXPECT_EQ(f.rc.history_size(), 2u);  // [0, 16) and [32, 64) are kept
  EXPECT_TRUE(f.rc.record_op(f.s2, "fresh", {R(16, 32)}).empty());
  EXPECT_EQ(f.rc.record_op(f.s2, "left", {R(0, 16)}).size(), 1u);
  EXPECT_EQ(f.rc.record_op(f.s2, "right", {R(40, 48)}).size(), 1u);
  f.rc.forget(kBase, kBase + 1024);
  EXPECT_EQ(f.rc.history_size(), 0u);
  EXPECT_TRUE(f.rc.record_op(f.s2, "after", {W(0, 64)}).empty());
}

TEST(RaceChecker, ReleaseForgetsOnlyWhatTheClockCompletesInTheRange) {
  Fixture f;
  Timeline s3 = f.rc.add_timeline("sim:0 stream 3");
  // A block [0, 64) used on s1 (the owner) and on s2 (record_stream), and read on s3 unordered.
  EXPECT_TRUE(f.rc.record_op(f.s2, "use on s2", {W(0, 64)}).empty());
  const VectorClock at_free = f.rc.snapshot(f.s2);  // "event" recorded on s2 when freed
  EXPECT_TRUE(f.rc.record_op(s3, "stray read", {R(48, 56)}).size() == 1u);  // races with s2
  EXPECT_TRUE(f.rc.record_op(f.s2, "later use on s2", {W(128, 192)}).empty());
  f.rc.release(kBase, kBase + 64, at_free);
  // The s2 use completed: the reuse on s1 does not race with it, but still with s3's read.
  std::vector<Race> reuse = f.rc.record_op(f.s1, "reuse", {W(0, 64)});
  ASSERT_EQ(reuse.size(), 1u);
  EXPECT_EQ(reuse[0].earlier_op, "stray read");
  // Nothing outside the range was released and no clock moved: s2's later write still races,
  // and other memory s2 wrote before the free is not ordered for s1 either.
  EXPECT_EQ(f.rc.record_op(f.s1, "other", {R(128, 192)}).size(), 1u);
  EXPECT_EQ(f.rc.snapshot(kHost), (VectorClock{0, 0, 0, 0}));
  EXPECT_EQ(f.rc.snapshot(f.s1)[static_cast<size_t>(f.s2)], 0u);
}

TEST(RaceChecker, ReleaseTrimsPartiallyOverlappingRecords) {
  Fixture f;
  f.rc.record_op(f.s2, "w", {W(0, 128)});
  f.rc.release(kBase + 32, kBase + 64, f.rc.snapshot(f.s2));
  EXPECT_EQ(f.rc.history_size(), 2u);  // [0, 32) and [64, 128) are kept
  EXPECT_TRUE(f.rc.record_op(f.s1, "inside", {W(32, 64)}).empty());
  EXPECT_EQ(f.rc.record_op(f.s1, "left", {R(0, 32)}).size(), 1u);
  EXPECT_EQ(f.rc.record_op(f.s1, "right", {R(64, 72)}).size(), 1u);
  // A clock that does not cover the record releases nothing.
  f.rc.record_op(f.s2, "w2", {W(256, 320)});
  f.rc.release(kBase + 256, kBase + 320, VectorClock{0, 0, 1});
  EXPECT_EQ(f.rc.record_op(f.s1, "after", {R(256, 320)}).size(), 1u);
  EXPECT_THROW(f.rc.release(kBase, kBase + 1, VectorClock(9, 0)), std::invalid_argument);
}

TEST(RaceChecker, HistoryStaysBoundedForRepeatedWritesOnOneStream) {
  Fixture f;
  for (int i = 0; i < 10000; ++i) {
    f.rc.record_op(f.s1, "w", {W(0, 64)});
    ASSERT_LE(f.rc.history_size(), 1u) << "after " << i + 1 << " writes";
  }
  for (int i = 0; i < 1000; ++i) f.rc.record_op(f.s1, "r", {R(0, 64)});
  EXPECT_LE(f.rc.history_size(), 2u);
}

TEST(RaceChecker, HistoryStaysBoundedForAlternatingSyncedWrites) {
  Fixture f;
  Timeline from = f.s1;
  Timeline to = f.s2;
  for (int i = 0; i < 10000; ++i) {
    EXPECT_TRUE(f.rc.record_op(from, "w", {W(0, 64), R(64, 128)}).empty());
    f.rc.join(to, f.rc.snapshot(from));
    std::swap(from, to);
    ASSERT_LE(f.rc.history_size(), 2u) << "after " << i + 1 << " ops";
  }
  EXPECT_TRUE(f.rc.races().empty());
}

TEST(RaceChecker, LongProgramOverFewStoragesStaysBounded) {
  RaceChecker rc;
  constexpr int kStreams = 3;
  constexpr uintptr_t kStorages = 4;
  std::vector<Timeline> streams;
  for (int i = 0; i < kStreams; ++i) streams.push_back(rc.add_timeline("s" + std::to_string(i)));
  std::mt19937 rng(7);
  // Per storage at most one write and one read per stream survive pruning.
  constexpr size_t kBound = kStorages * 2 * kStreams;
  for (int i = 0; i < 100000; ++i) {
    const Timeline t = streams[rng() % kStreams];
    const uintptr_t a = rng() % kStorages, b = rng() % kStorages, c = rng() % kStorages;
    rc.record_op(t, "op",
                 {R(a * 256, a * 256 + 256), R(b * 256, b * 256 + 256), W(c * 256, c * 256 + 256)});
    if (rng() % 4 == 0) rc.join(streams[rng() % kStreams], rc.snapshot(t));
    if (rng() % 64 == 0) rc.join_timeline(kHost, t);
    if (i % 1000 == 0) rc.clear_races();
    ASSERT_LE(rc.history_size(), kBound) << "after " << i + 1 << " ops";
  }
}

TEST(RaceChecker, ThousandOpsOverHundredStoragesIsFast) {
  RaceChecker rc;
  std::vector<Timeline> streams;
  for (int i = 0; i < 4; ++i) streams.push_back(rc.add_timeline("s" + std::to_string(i)));
  std::mt19937 rng(11);
  const auto start = std::chrono::steady_clock::now();
  size_t racing = 0;
  for (int i = 0; i < 1000; ++i) {
    const Timeline t = streams[rng() % 4];
    std::vector<Access> accesses;
    for (int k = 0; k < 3; ++k) {
      const uintptr_t s = rng() % 100;
      accesses.push_back(Access{kBase + s * 4096, kBase + s * 4096 + 4096, k == 2, "storage"});
    }
    racing += rc.record_op(t, "op", accesses).empty() ? 0 : 1;
    if (rng() % 3 == 0) rc.join(streams[rng() % 4], rc.snapshot(t));
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(racing, 0u);
  EXPECT_LT(ms, 100.0);
  EXPECT_LE(rc.history_size(), 100u * 2 * 4);
}

namespace {

// A brute-force reference: every op and sync action is a node; happens-before is the transitive
// closure of program order per timeline (host included) and the sync edges. Nodes are created in
// order and edges always point forward, so each node's ancestors are the union of its
// predecessors' ancestors and the predecessors themselves.
class Reference {
 public:
  explicit Reference(int timelines) : last_(static_cast<size_t>(timelines), -1) {}

  int op(Timeline t, std::vector<Access> accesses) {
    const int node = add_node(t, {last_[0]});
    ops_.push_back(Op{node, t, std::move(accesses)});
    return node;
  }
  // A node on `t` after its current last node and `other` (a node id, or -1).
  int sync(Timeline t, int other) { return add_node(t, {other}); }
  int last(Timeline t) const { return last_[static_cast<size_t>(t)]; }

  bool happens_before(int a, int b) const {
    const auto& row = ancestors_[static_cast<size_t>(b)];
    const auto word = static_cast<size_t>(a) / 64;
    return word < row.size() && ((row[word] >> (a % 64)) & 1u) != 0;
  }

  static bool conflict(const Access& x, const Access& y) {
    return (x.write || y.write) && x.begin < y.end && y.begin < x.end;
  }

  // Whether op j races with op i < j.
  bool races(size_t i, size_t j) const {
    const Op& a = ops_[i];
    const Op& b = ops_[j];
    if (a.timeline == b.timeline || happens_before(a.node, b.node)) return false;
    for (const Access& x : a.accesses) {
      for (const Access& y : b.accesses) {
        if (conflict(x, y)) return true;
      }
    }
    return false;
  }

  const std::vector<Access>& accesses(size_t i) const { return ops_[i].accesses; }
  Timeline timeline(size_t i) const { return ops_[i].timeline; }

 private:
  struct Op {
    int node;
    Timeline timeline;
    std::vector<Access> accesses;
  };

  int add_node(Timeline t, std::vector<int> extra) {
    const int node = static_cast<int>(ancestors_.size());
    std::vector<uint64_t> row(static_cast<size_t>(node) / 64 + 1, 0);
    extra.push_back(last_[static_cast<size_t>(t)]);
    for (const int p : extra) {
      if (p < 0) continue;
      const auto& prow = ancestors_[static_cast<size_t>(p)];
      for (size_t w = 0; w < prow.size(); ++w) row[w] |= prow[w];
      row[static_cast<size_t>(p) / 64] |= uint64_t{1} << (p % 64);
    }
    ancestors_.push_back(std::move(row));
    last_[static_cast<size_t>(t)] = node;
    return node;
  }

  std::vector<int> last_;
  std::vector<std::vector<uint64_t>> ancestors_;
  std::vector<Op> ops_;
};

}  // namespace

TEST(RaceChecker, RandomProgramsMatchBruteForceReference) {
  std::mt19937 rng(20240611);
  size_t racing_total = 0, clean_total = 0, pruned_programs = 0;
  for (int program = 0; program < 300; ++program) {
    RaceChecker rc;
    const int streams = 2 + program % 3;  // 2..4 streams, plus the host
    for (int s = 1; s <= streams; ++s) rc.add_timeline("stream " + std::to_string(s));
    Reference ref(streams + 1);
    struct Event {
      VectorClock clock;
      int node;
    };
    std::vector<Event> events;
    std::vector<bool> checker_raced;
    const auto stream = [&] { return static_cast<Timeline>(1 + rng() % streams); };
    const int steps = 60 + static_cast<int>(rng() % 140);
    size_t unpruned = 0;
    for (int step = 0; step < steps; ++step) {
      const unsigned action = rng() % 100;
      if (action < 60) {
        const Timeline t = stream();
        std::vector<Access> accesses;
        const int n = 1 + static_cast<int>(rng() % 3);
        for (int k = 0; k < n; ++k) {
          // Ranges over 128 bytes, lengths 1..64 and whole-space "reuse" writes.
          uintptr_t begin = rng() % 128, length = 1 + rng() % 64;
          if (rng() % 10 == 0) begin = 0, length = 128;
          accesses.push_back(
              Access{begin, std::min<uintptr_t>(begin + length, 128), rng() % 2 == 0, "m"});
        }
        const std::string name = "op" + std::to_string(checker_raced.size());
        const auto races = rc.record_op(t, name, accesses);
        unpruned += accesses.size();
        checker_raced.push_back(!races.empty());
        const size_t j = checker_raced.size() - 1;
        ref.op(t, accesses);
        // Every reported race is a real unordered conflicting pair with an earlier op.
        for (const Race& race : races) {
          ASSERT_EQ(race.later_op, name);
          const size_t i = std::stoul(race.earlier_op.substr(2));
          ASSERT_LT(i, j);
          EXPECT_TRUE(ref.races(i, j)) << "program " << program << ": " << race.to_string();
          EXPECT_EQ(race.earlier_timeline, rc.label(ref.timeline(i)));
          EXPECT_LT(race.begin, race.end);
        }
      } else if (action < 72) {  // record an event on a stream
        const Timeline t = stream();
        events.push_back(Event{rc.snapshot(t), ref.sync(t, -1)});
      } else if (action < 84) {  // a stream waits for an event
        if (events.empty()) continue;
        const Event& e = events[rng() % events.size()];
        const Timeline t = stream();
        rc.join(t, e.clock);
        ref.sync(t, e.node);
      } else if (action < 90) {  // host synchronizes a stream
        const Timeline t = stream();
        rc.join_timeline(kHost, t);
        ref.sync(kHost, ref.last(t));
      } else if (action < 95) {  // host synchronizes an event
        if (events.empty()) continue;
        const Event& e = events[rng() % events.size()];
        rc.join(kHost, e.clock);
        ref.sync(kHost, e.node);
      } else {  // a stream joins another's current position directly
        const Timeline into = stream(), from = stream();
        rc.join_timeline(into, from);
        if (into != from) ref.sync(into, ref.last(from));
      }
    }
    if (rc.history_size() < unpruned) ++pruned_programs;
    // The ops with at least one race are the same as the brute force's.
    for (size_t j = 0; j < checker_raced.size(); ++j) {
      bool expected = false;
      for (size_t i = 0; i < j && !expected; ++i) expected = ref.races(i, j);
      EXPECT_EQ(checker_raced[j], expected) << "program " << program << ", op " << j;
      (expected ? racing_total : clean_total) += 1;
    }
    ASSERT_FALSE(::testing::Test::HasFailure()) << "first failing program: " << program;
  }
  // The programs exercise both outcomes and the pruning.
  EXPECT_GT(racing_total, 1000u);
  EXPECT_GT(clean_total, 1000u);
  EXPECT_GT(pruned_programs, 250u);
}

TEST(RaceChecker, ConcurrentRecordingOnOwnTimelines) {
  RaceChecker rc;
  constexpr int kThreads = 4;
  constexpr int kOps = 2000;
  std::vector<std::thread> threads;
  std::vector<size_t> own_races(kThreads, 0);
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&rc, &own_races, i] {
      const Timeline t = rc.add_timeline("thread " + std::to_string(i));
      const std::string& label = rc.label(t);
      const uintptr_t mine = 0x100000 * static_cast<uintptr_t>(i + 1);
      for (int k = 0; k < kOps; ++k) {
        // Private memory: never races. Shared memory is only read.
        const auto races = rc.record_op(
            t, "op",
            {Access{mine, mine + 256, k % 2 == 0, label}, Access{0, 64, false, "shared"},
             Access{mine + 512 + static_cast<uintptr_t>(k % 8) * 16,
                    mine + 528 + static_cast<uintptr_t>(k % 8) * 16, true, label}});
        own_races[static_cast<size_t>(i)] += races.size();
        if (k % 16 == 0) {
          rc.join_timeline(kHost, t);
          rc.join(t, rc.snapshot(kHost));
          (void)rc.history_size();
          (void)rc.races();
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(own_races[static_cast<size_t>(i)], 0u);
  EXPECT_TRUE(rc.races().empty());
  // Per thread: the private block (one write, one read), 8 slots, one shared read.
  EXPECT_LE(rc.history_size(), static_cast<size_t>(kThreads) * (2 + 8 + 1));
  // A write to the shared range now races with the unsynchronized reads of every thread.
  const Timeline late = rc.add_timeline("late");
  EXPECT_EQ(rc.record_op(late, "w", {Access{0, 64, true, "shared"}}).size(),
            static_cast<size_t>(kThreads));
}
