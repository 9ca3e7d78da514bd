#include "core/dependency_tracker.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

using torch_pipeline::core::DependencyTracker;
using torch_pipeline::core::Position;
using torch_pipeline::core::StorageId;
using torch_pipeline::core::StreamId;

namespace {

using Waits = std::vector<Position>;
const Waits kNone{};

Position at(StreamId stream, uint64_t seq) { return Position{stream, seq}; }

// Storage ids used by the unit cases.
constexpr StorageId kX = 100, kY = 101, kZ = 102;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Positions
// ---------------------------------------------------------------------------------------------

TEST(DependencyTracker, PositionsCountEachStreamsOpsFromOne) {
  DependencyTracker t;
  EXPECT_EQ(t.launch(7, {}, {}).position, at(7, 1));
  EXPECT_EQ(t.launch(7, {kX}, {}).position, at(7, 2));
  EXPECT_EQ(t.launch(-3, {}, {kX}).position, at(-3, 1));
  EXPECT_EQ(t.launch(7, {}, {}).position, at(7, 3));
  EXPECT_EQ(t.num_launched(7), 3u);
  EXPECT_EQ(t.num_launched(-3), 1u);
  EXPECT_EQ(t.num_launched(42), 0u);
}

TEST(DependencyTracker, ALaunchWithNoAccessesKeepsTheClockItWasOrderedAfter) {
  // (the launch without accesses takes a shorter path: it must still carry the stream's clock,
  // and the stream lookup it caches must follow the stream asked for, stream 0 included)
  DependencyTracker t;
  EXPECT_EQ(t.launch(1, {}, {kX}).position, at(1, 1));      // 1 writes X
  EXPECT_EQ(t.launch(0, {kX}, {}).waits, Waits{at(1, 1)});  // 0 waits for it
  EXPECT_EQ(t.launch(0, {}, {}).position, at(0, 2));
  EXPECT_EQ(t.launch(2, {}, {}).position, at(2, 1));
  EXPECT_EQ(t.launch(0, {}, {}).position, at(0, 3));
  // An op after 0's empty launches writes Y; 2 reads Y and X: it waits for 0 only, since 0's
  // position carries 1's write of X.
  EXPECT_EQ(t.launch(0, {}, {kY}).position, at(0, 4));
  EXPECT_EQ(t.launch(2, {kX, kY}, {}).waits, Waits{at(0, 4)});
  EXPECT_TRUE(t.is_ordered(2, at(1, 1)));
  EXPECT_EQ(t.num_launched(0), 4u);
  EXPECT_EQ(t.num_launched(1), 1u);
  EXPECT_EQ(t.num_launched(2), 2u);
}

// ---------------------------------------------------------------------------------------------
// The rules
// ---------------------------------------------------------------------------------------------

TEST(DependencyTracker, ReadAfterWriteOnAnotherStreamWaitsForTheWriter) {
  DependencyTracker t;
  EXPECT_EQ(t.launch(1, {}, {kX}).waits, kNone);
  const auto r = t.launch(2, {kX}, {});
  EXPECT_EQ(r.waits, Waits{at(1, 1)});
  EXPECT_EQ(r.position, at(2, 1));
}

TEST(DependencyTracker, ReadAfterWriteWaitsForTheLatestWriter) {
  DependencyTracker t;
  t.launch(1, {}, {kX});
  t.launch(1, {}, {kY});
  t.launch(1, {}, {kX});  // 1@3 is x's last writer
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, Waits{at(1, 3)});
}

TEST(DependencyTracker, SameStreamNeverWaits) {
  DependencyTracker t;
  EXPECT_EQ(t.launch(1, {}, {kX}).waits, kNone);
  EXPECT_EQ(t.launch(1, {kX}, {}).waits, kNone);
  EXPECT_EQ(t.launch(1, {kX}, {kX}).waits, kNone);
  EXPECT_EQ(t.launch(1, {kX}, {kY}).waits, kNone);
  EXPECT_EQ(t.launch(1, {}, {kX, kY}).waits, kNone);
  // A reader on another stream, then the writer's own stream reads again: still nothing.
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, Waits{at(1, 5)});
  EXPECT_EQ(t.launch(2, {kX}, {kX}).waits, kNone);  // x's readers since 1@5: only 2@1 (own)
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, kNone);
}

TEST(DependencyTracker, WriteAfterReadWaitsForEveryReaderOnOtherStreams) {
  DependencyTracker t;
  t.launch(1, {}, {kX});                                    // 1@1
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, Waits{at(1, 1)});  // 2@1
  EXPECT_EQ(t.launch(3, {kX}, {}).waits, Waits{at(1, 1)});  // 3@1
  t.launch(1, {kX}, {});                                    // 1@2: a reader on the writer's stream
  EXPECT_EQ(t.launch(1, {}, {kX}).waits, (Waits{at(2, 1), at(3, 1)}));  // 1@3
  // The write cleared the readers: the next writer waits for 1@3 only (2@1 and 3@1 are implied).
  EXPECT_EQ(t.launch(4, {}, {kX}).waits, Waits{at(1, 3)});
}

TEST(DependencyTracker, WriteAfterReadOfANeverWrittenStorage) {
  DependencyTracker t;
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, kNone);
  EXPECT_EQ(t.launch(3, {kX}, {}).waits, kNone);
  EXPECT_EQ(t.launch(1, {}, {kX}).waits, (Waits{at(2, 1), at(3, 1)}));
}

TEST(DependencyTracker, WriteAfterReadWaitsForTheLatestReaderOfEachStream) {
  DependencyTracker t;
  t.launch(2, {kX}, {});  // 2@1
  t.launch(2, {kY}, {});  // 2@2
  t.launch(2, {kX}, {});  // 2@3
  EXPECT_EQ(t.launch(1, {}, {kX}).waits, Waits{at(2, 3)});
}

TEST(DependencyTracker, WriteAfterWriteWaitsForTheWriter) {
  DependencyTracker t;
  t.launch(1, {}, {kX});
  EXPECT_EQ(t.launch(2, {}, {kX}).waits, Waits{at(1, 1)});
  EXPECT_EQ(t.launch(3, {}, {kX}).waits, Waits{at(2, 1)});  // 1@1 is implied by 2@1
}

TEST(DependencyTracker, ReadAfterReadNeverWaits) {
  DependencyTracker t;
  for (StreamId s = 1; s <= 4; ++s) EXPECT_EQ(t.launch(s, {kX}, {}).waits, kNone);
  t.launch(5, {}, {kY});
  EXPECT_EQ(t.launch(1, {kY}, {}).waits, Waits{at(5, 1)});
  EXPECT_EQ(t.launch(2, {kY}, {}).waits, Waits{at(5, 1)});  // not for the reader 1@..
  EXPECT_EQ(t.launch(3, {kY}, {}).waits, Waits{at(5, 1)});
  EXPECT_EQ(t.launch(1, {kY}, {}).waits, kNone);
  EXPECT_EQ(t.launch(2, {kY}, {}).waits, kNone);
}

TEST(DependencyTracker, AStorageInBothSetsCountsAsWrittenAndDuplicatesAreIgnored) {
  DependencyTracker t;
  EXPECT_EQ(t.launch(1, {kX, kX}, {kX, kX}).waits, kNone);  // 1@1 writes x
  EXPECT_EQ(t.num_records(), 2u);  // the last writer and one use; no reader record
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, Waits{at(1, 1)});  // read after that write
  // 3 writes x: the last writer 1@1 and the reader 2@1; 2@1 implies 1@1.
  EXPECT_EQ(t.launch(3, {kX}, {kX}).waits, Waits{at(2, 1)});
  EXPECT_EQ(t.launch(4, {kX, kX}, {}).waits, Waits{at(3, 1)});
}

// ---------------------------------------------------------------------------------------------
// Deduplication
// ---------------------------------------------------------------------------------------------

TEST(DependencyTracker, ASecondReaderOnTheSameStreamDoesNotWaitAgain) {
  DependencyTracker t;
  t.launch(1, {}, {kX, kY});  // 1@1
  t.launch(1, {}, {kZ});      // 1@2
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, Waits{at(1, 1)});
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, kNone);
  EXPECT_EQ(t.launch(2, {kY}, {}).waits, kNone);  // same producer position, already waited for
  EXPECT_EQ(t.launch(2, {kZ}, {}).waits, Waits{at(1, 2)});  // a later position: wait again
  EXPECT_EQ(t.launch(2, {kX, kY, kZ}, {}).waits, kNone);
}

TEST(DependencyTracker, AtMostOneWaitPerProducerStreamTheLatest) {
  DependencyTracker t;
  t.launch(1, {}, {kX});  // 1@1
  t.launch(1, {}, {kY});  // 1@2
  t.launch(5, {}, {kZ});  // 5@1
  EXPECT_EQ(t.launch(3, {kX, kY, kZ}, {}).waits, (Waits{at(1, 2), at(5, 1)}));
}

TEST(DependencyTracker, WaitsAreSortedByStreamId) {
  DependencyTracker t;
  t.launch(9, {}, {kX});
  t.launch(-4, {}, {kY});
  t.launch(2, {}, {kZ});
  EXPECT_EQ(t.launch(0, {kX, kY, kZ}, {}).waits, (Waits{at(-4, 1), at(2, 1), at(9, 1)}));
}

TEST(DependencyTracker, TransitiveOrderingAcrossLaunchesSuppressesWaits) {
  DependencyTracker t;
  const StreamId S = 1, T = 2, U = 3;
  t.launch(U, {}, {kX});                                      // U@1 writes x
  EXPECT_EQ(t.launch(T, {kX}, {kY}).waits, Waits{at(U, 1)});  // T@1 reads x, writes y
  EXPECT_EQ(t.launch(S, {kY}, {}).waits, Waits{at(T, 1)});    // S waits for T@1 ...
  EXPECT_EQ(t.launch(S, {kX}, {}).waits, kNone);              // ... so it is after U@1 too
  EXPECT_TRUE(t.is_ordered(S, at(U, 1)));
}

TEST(DependencyTracker, TransitiveOrderingWithinOneLaunchKeepsTheMinimalSet) {
  DependencyTracker t;
  const StreamId S = 1, T = 2, U = 3;
  t.launch(U, {}, {kX});                                      // U@1
  EXPECT_EQ(t.launch(T, {kX}, {kY}).waits, Waits{at(U, 1)});  // T@1, after U@1
  // S reads x (writer U@1) and y (writer T@1): T@1 implies U@1.
  EXPECT_EQ(t.launch(S, {kX, kY}, {}).waits, Waits{at(T, 1)});
  // And in the other listing order, and for a write (waits for readers of x: T@1).
  DependencyTracker t2;
  t2.launch(U, {}, {kX});
  t2.launch(T, {kX}, {kY});
  EXPECT_EQ(t2.launch(S, {kY}, {kX}).waits, Waits{at(T, 1)});
}

// ---------------------------------------------------------------------------------------------
// External waits and host completions
// ---------------------------------------------------------------------------------------------

TEST(DependencyTracker, WaitedSuppressesWaits) {
  DependencyTracker t;
  t.launch(1, {}, {kX});  // 1@1
  t.launch(1, {}, {kY});  // 1@2
  t.waited(2, at(1, 1));
  EXPECT_TRUE(t.is_ordered(2, at(1, 1)));
  EXPECT_FALSE(t.is_ordered(2, at(1, 2)));
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, kNone);
  EXPECT_EQ(t.launch(2, {kY}, {}).waits, Waits{at(1, 2)});  // a later position is not covered
  EXPECT_EQ(t.launch(3, {kX}, {}).waits, Waits{at(1, 1)});  // other streams are not covered
}

TEST(DependencyTracker, WaitedIsTransitiveAndUsesTheClockOfThatPosition) {
  DependencyTracker t;
  const StreamId S = 1, T = 2, U = 3, V = 4;
  t.launch(U, {}, {kX});                                    // U@1 writes x
  t.launch(T, {}, {});                                      // T@1: ordered after nothing
  EXPECT_EQ(t.launch(T, {kX}, {}).waits, Waits{at(U, 1)});  // T@2: after U@1
  t.waited(S, at(T, 1));
  EXPECT_FALSE(t.is_ordered(S, at(U, 1)));
  EXPECT_EQ(t.launch(S, {kX}, {}).waits, Waits{at(U, 1)});  // T@1 was not after U@1
  t.waited(V, at(T, 2));
  EXPECT_TRUE(t.is_ordered(V, at(U, 1)));
  EXPECT_EQ(t.launch(V, {kX}, {}).waits, kNone);  // T@2 was
}

TEST(DependencyTracker, WaitedOnTheSameStreamOrForNothingChangesNothing) {
  DependencyTracker t;
  t.launch(1, {}, {kX});
  t.waited(1, at(1, 1));
  t.waited(2, at(1, 0));
  t.waited(2, at(77, 0));  // a stream that never launched, position 0: nothing to wait for
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, Waits{at(1, 1)});
}

TEST(DependencyTracker, PositionsNotLaunchedYetAreRejected) {
  DependencyTracker t;
  t.launch(1, {}, {kX});
  EXPECT_THROW(t.waited(2, at(1, 2)), std::invalid_argument);
  EXPECT_THROW(t.waited(2, at(9, 1)), std::invalid_argument);
  EXPECT_THROW(t.completed(at(1, 2)), std::invalid_argument);
  EXPECT_THROW(t.completed(at(9, 1)), std::invalid_argument);
  EXPECT_FALSE(t.is_ordered(2, at(1, 2)));
  EXPECT_FALSE(t.is_ordered(2, at(9, 1)));
  EXPECT_TRUE(t.is_ordered(1, at(1, 1)));  // program order
  EXPECT_TRUE(t.is_ordered(2, at(9, 0)));
  // Nothing changed: the rejected calls did not order anything.
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, Waits{at(1, 1)});
}

TEST(DependencyTracker, CompletedSuppressesWaitsOnEveryStream) {
  DependencyTracker t;
  t.launch(1, {}, {kX});  // 1@1
  t.launch(1, {}, {kY});  // 1@2
  t.launch(2, {}, {kZ});  // 2@1: launched before the completion, by another stream
  t.completed(at(1, 1));
  EXPECT_TRUE(t.is_ordered(3, at(1, 1)));
  EXPECT_FALSE(t.is_ordered(3, at(1, 2)));
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, kNone);
  EXPECT_EQ(t.launch(3, {}, {kX}).waits, Waits{at(2, 2)});  // the reader 2@2, not the writer
  EXPECT_EQ(t.launch(4, {kY}, {}).waits, Waits{at(1, 2)});  // 1@2 is not known complete
  EXPECT_EQ(t.launch(4, {kZ}, {}).waits, Waits{at(2, 1)});
}

TEST(DependencyTracker, CompletedIsTransitive) {
  DependencyTracker t;
  const StreamId S = 1, T = 2, U = 3;
  t.launch(U, {}, {kX});                                      // U@1
  EXPECT_EQ(t.launch(T, {kX}, {kY}).waits, Waits{at(U, 1)});  // T@1, after U@1
  t.completed(at(T, 1));  // e.g. an event synchronize: U@1 is complete too
  EXPECT_TRUE(t.is_ordered(S, at(U, 1)));
  EXPECT_EQ(t.launch(S, {kX}, {}).waits, kNone);
  EXPECT_EQ(t.launch(S, {}, {kY}).waits, kNone);
  EXPECT_EQ(t.launch(S, {}, {kX}).waits, kNone);  // readers of x: T@1, complete
}

TEST(DependencyTracker, CompletedOfAnOlderPositionUsesThatPositionsClock) {
  DependencyTracker t;
  const StreamId S = 1, T = 2, U = 3;
  t.launch(U, {}, {kX});                                    // U@1
  t.launch(T, {}, {kY});                                    // T@1: after nothing
  EXPECT_EQ(t.launch(T, {kX}, {}).waits, Waits{at(U, 1)});  // T@2: after U@1
  t.completed(at(T, 1));
  EXPECT_EQ(t.launch(S, {kY}, {}).waits, kNone);
  EXPECT_EQ(t.launch(S, {kX}, {}).waits, Waits{at(U, 1)});
}

TEST(DependencyTracker, OldPositionsBeyondTheHistoryLimitAreTreatedConservatively) {
  const StreamId S = 1, T = 2, U = 3, V = 4;
  for (const size_t limit : {size_t{2}, DependencyTracker::kDefaultHistoryLimit}) {
    SCOPED_TRACE(limit);
    DependencyTracker t(limit);
    t.launch(U, {}, {kX});                                    // U@1
    EXPECT_EQ(t.launch(T, {kX}, {}).waits, Waits{at(U, 1)});  // T@1, after U@1
    // Ten more clock changes of T, each a new history entry.
    for (StorageId v = 1; v <= 10; ++v) {
      t.launch(V, {}, {v});
      EXPECT_EQ(t.launch(T, {v}, {}).waits, Waits{at(V, v)});
    }
    t.waited(S, at(T, 1));
    const Waits expected = limit == 2 ? Waits{at(U, 1)} : kNone;  // an extra wait, never a miss
    EXPECT_EQ(t.launch(S, {kX}, {}).waits, expected);
  }
}

// ---------------------------------------------------------------------------------------------
// Forgetting and allocator safety
// ---------------------------------------------------------------------------------------------

TEST(DependencyTracker, ForgetDropsTheStorageButPositionsKeepGrowing) {
  DependencyTracker t;
  t.launch(1, {}, {kX});  // 1@1
  t.launch(2, {kY}, {});  // 2@1
  EXPECT_EQ(t.num_storages(), 2u);
  t.forget(kX);
  t.forget(kZ);  // unknown: ignored
  EXPECT_EQ(t.num_storages(), 1u);
  EXPECT_TRUE(t.uses_off(kX, 3).empty());
  // x's id is reused for a new storage: nothing of the old one is waited for.
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, kNone);
  EXPECT_EQ(t.launch(3, {}, {kX}).waits, Waits{at(2, 2)});
  // Stream 1 continues at seq 2: positions are never reused (no stale-event aliasing).
  EXPECT_EQ(t.launch(1, {}, {kX}).position, at(1, 2));
  t.forget(kX);
  t.forget(kY);
  EXPECT_EQ(t.num_storages(), 0u);
}

TEST(DependencyTracker, DefineMakesTheOpTheWriterOfFreshStorages) {
  DependencyTracker t;
  const Position p = t.launch(1, {kY}, {}).position;  // 1@1 reads y and creates x
  t.define(p, {kX});
  // x is written by 1@1: a read on stream 2 waits for it, a read on stream 1 does not.
  EXPECT_EQ(t.launch(2, {kX}, {}).waits, Waits{at(1, 1)});
  EXPECT_EQ(t.launch(1, {kX}, {}).waits, kNone);
  // Its uses start at the definition (the latest per stream: 1@2, the read above).
  EXPECT_EQ(t.uses_off(kX, 3), (Waits{at(1, 2), at(2, 1)}));
}

TEST(DependencyTracker, DefineReplacesTheStateOfARecycledId) {
  DependencyTracker t;
  t.launch(2, {}, {kX});  // 2@1: the old storage behind id x
  t.launch(3, {kX}, {});  // 3@1 (waits for 2@1)
  const Position p = t.launch(1, {}, {}).position;
  t.define(p, {kX});  // id x now names a new storage created by 1@1
  // A write on stream 4 waits for the new writer only: the old writer and reader are gone.
  EXPECT_EQ(t.launch(4, {}, {kX}).waits, Waits{at(1, 1)});
  EXPECT_EQ(t.uses_off(kX, 4), kNone);
}

TEST(DependencyTracker, DefineUsesTheClockOfItsPosition) {
  DependencyTracker t;
  t.launch(2, {}, {kY});                              // 2@1 writes y
  const Position p = t.launch(1, {kY}, {}).position;  // 1@1 waits for 2@1, creates x
  t.define(p, {kX});
  // A write of y on stream 3 after reading x: waiting for 1@1 implies 2@1.
  EXPECT_EQ(t.launch(3, {kX}, {}).waits, Waits{at(1, 1)});
  EXPECT_EQ(t.launch(3, {}, {kY}).waits, kNone);
}

TEST(DependencyTracker, UsesToldAfterTheFactActAsIfLaunchedWithThem) {
  // Stream 1 makes x at 1@1 (after waiting for 2@1's write of y), writes it at 1@2 and reads it
  // at 1@3 without telling the tracker; then it tells define() and used() (Note [Home-stream
  // uses]). A write of x on stream 3 waits for the read 1@3; a read on stream 4 for the write 1@2.
  DependencyTracker t;
  t.launch(2, {}, {kY});                              // 2@1 writes y
  const Position p = t.launch(1, {kY}, {}).position;  // 1@1 waits for it
  t.launch(1, {}, {});
  t.launch(1, {}, {});
  t.define(p, {kX});
  t.used(at(1, 2), kX, /*write=*/true);
  t.used(at(1, 3), kX, /*write=*/false);
  EXPECT_EQ(t.launch(4, {kX}, {}).waits, Waits{at(1, 2)});
  EXPECT_EQ(t.launch(3, {}, {kX}).waits, (Waits{at(1, 3), at(4, 1)}));
  // The told ops carry their clocks: stream 4, ordered after 1@2, is ordered after 2@1 too, so a
  // write of y there waits for nothing (neither y's writer 2@1 nor its reader 1@1).
  EXPECT_EQ(t.launch(4, {}, {kY}).waits, kNone);
  EXPECT_EQ(t.uses_off(kX, 5), (Waits{at(1, 3), at(3, 1), at(4, 1)}));
  EXPECT_THROW(t.used(at(1, 9), kX, true), std::invalid_argument);
}

TEST(DependencyTracker, DefineRejectsPositionsNotLaunched) {
  DependencyTracker t;
  EXPECT_THROW(t.define(at(1, 1), {kX}), std::invalid_argument);
  EXPECT_THROW(t.define(at(1, 0), {kX}), std::invalid_argument);
  t.launch(1, {}, {});
  EXPECT_THROW(t.define(at(1, 2), {kX}), std::invalid_argument);
  EXPECT_EQ(t.num_storages(), 0u);
}

TEST(DependencyTracker, UsesOffListsTheLatestUseOfOtherStreamsNotYetOrdered) {
  DependencyTracker t;
  const StreamId home = 1;
  t.launch(home, {}, {kX});  // 1@1
  t.launch(2, {kX}, {});     // 2@1
  t.launch(3, {kX}, {});     // 3@1
  t.launch(2, {kX}, {});     // 2@2
  EXPECT_TRUE(t.uses_off(kY, home).empty());
  EXPECT_EQ(t.uses_off(kX, home), (Waits{at(2, 2), at(3, 1)}));
  // Seen from stream 2: its own use does not count, and 1@1 is ordered before its next op.
  EXPECT_EQ(t.uses_off(kX, 2), Waits{at(3, 1)});
  // Seen from a stream that never ran: everything.
  EXPECT_EQ(t.uses_off(kX, 9), (Waits{at(1, 1), at(2, 2), at(3, 1)}));
  // Writes are uses too, and a write does not drop the uses before it.
  t.launch(4, {}, {kX});  // 4@1, waits for 2@2 and 3@1
  EXPECT_EQ(t.uses_off(kX, home), (Waits{at(2, 2), at(3, 1), at(4, 1)}));
  // Uses that home is ordered after are left out.
  t.waited(home, at(3, 1));
  EXPECT_EQ(t.uses_off(kX, home), (Waits{at(2, 2), at(4, 1)}));
  t.completed(at(2, 2));
  EXPECT_EQ(t.uses_off(kX, home), Waits{at(4, 1)});
  t.completed(at(4, 1));
  EXPECT_TRUE(t.uses_off(kX, home).empty());
  t.launch(2, {kX}, {});  // 2@3
  EXPECT_EQ(t.uses_off(kX, home), Waits{at(2, 3)});
  t.forget(kX);
  EXPECT_TRUE(t.uses_off(kX, home).empty());
}

// ---------------------------------------------------------------------------------------------
// Bounded memory
// ---------------------------------------------------------------------------------------------

TEST(DependencyTracker, RecordsPerStorageStayBounded) {
  DependencyTracker t;
  // One storage read over and over from three streams, written now and then: at most the last
  // writer, one reader per stream and one use per stream.
  for (int i = 0; i < 3000; ++i) {
    t.launch(1 + i % 3, {kX}, {});
    if (i % 500 == 499) t.launch(4, {}, {kX});
    EXPECT_LE(t.num_records(), 1u + 3u + 4u);
  }
  EXPECT_EQ(t.num_records(), 1u + 4u);  // the loop ended with a write: no readers since
  for (StreamId s = 1; s <= 3; ++s) t.launch(s, {kX}, {});
  EXPECT_EQ(t.num_records(), 1u + 3u + 4u);
  t.launch(2, {}, {kX});  // a write clears the readers
  EXPECT_EQ(t.num_records(), 1u + 4u);
  t.forget(kX);
  EXPECT_EQ(t.num_records(), 0u);
}

TEST(DependencyTracker, ClockHistoryIsBoundedAndPrunedByCompletions) {
  const StreamId T = 1, V = 2;
  DependencyTracker limited(8);
  DependencyTracker t;
  for (StorageId v = 1; v <= 100; ++v) {
    for (DependencyTracker* tr : {&limited, &t}) {
      tr->launch(V, {}, {v});                              // V's clock never changes: one entry
      EXPECT_EQ(tr->launch(T, {v}, {}).waits.size(), 1u);  // each a clock change of T
    }
  }
  EXPECT_EQ(limited.num_history_entries(), 8u + 1u);
  EXPECT_EQ(t.num_history_entries(), 100u + 1u);
  // The host knows T@100 completed: no position up to it needs a clock any more.
  t.completed(at(T, 100));
  t.launch(V, {}, {kX});
  EXPECT_EQ(t.launch(T, {kX}, {}).waits, Waits{at(V, 101)});  // the next change of T prunes
  EXPECT_EQ(t.num_history_entries(), 1u + 1u);
}

// ---------------------------------------------------------------------------------------------
// Random workloads against a simulated executor
// ---------------------------------------------------------------------------------------------

namespace {

using Clock = std::vector<uint64_t>;  // indexed by the executor's stream index

void join_into(Clock& into, const Clock& from) {
  for (size_t i = 0; i < into.size(); ++i) into[i] = std::max(into[i], from[i]);
}

struct Access {
  size_t stream;
  uint64_t seq;
  bool write;
};

// Executes the tracker's decisions: each op is ordered after the earlier ops of its stream, the
// waits the tracker returned for it, the positions waited() reported for its stream, and every
// position completed() reported before its launch. Keeps every op's exact vector clock and, per
// storage, every access since the storage was last forgotten.
class Executor {
 public:
  Executor(std::vector<StreamId> ids, size_t history_limit, bool check_minimal)
      : ids_(std::move(ids)),
        tracker_(history_limit),
        check_minimal_(check_minimal),
        ops_(ids_.size()),
        stream_clock_(ids_.size(), Clock(ids_.size(), 0)),
        host_(ids_.size(), 0) {}

  size_t num_streams() const { return ids_.size(); }
  uint64_t launched(size_t s) const { return ops_[s].size(); }
  DependencyTracker& tracker() { return tracker_; }
  uint64_t waits_seen() const { return waits_seen_; }
  uint64_t conflicts_seen() const { return conflicts_seen_; }

  void launch(size_t s, const std::vector<StorageId>& reads, const std::vector<StorageId>& writes) {
    const auto result = tracker_.launch(ids_[s], reads, writes);
    const uint64_t seq = launched(s) + 1;
    ASSERT_EQ(result.position, at(ids_[s], seq));

    std::map<StorageId, bool> accesses;  // storage -> written
    for (const StorageId x : reads) accesses.emplace(x, false);
    for (const StorageId x : writes) accesses[x] = true;

    Clock base = stream_clock_[s];
    join_into(base, host_);
    std::vector<size_t> producers;
    for (const Position& w : result.waits) {
      const size_t p = index(w.stream);
      ASSERT_NE(p, s) << "a wait between ops of the same stream: " << w;
      ASSERT_TRUE(std::find(producers.begin(), producers.end(), p) == producers.end())
          << "two waits for one producer stream in one launch: " << w;
      ASSERT_GE(w.seq, 1u);
      ASSERT_LE(w.seq, launched(p)) << "a wait for an op not launched yet: " << w;
      producers.push_back(p);
      // Every wait is for a conflicting access of one of the op's storages.
      bool conflicting = false;
      for (const auto& a : accesses) {
        for (const Access& prev : history_[a.first]) {
          if (prev.stream == p && prev.seq == w.seq && (prev.write || a.second)) conflicting = true;
        }
      }
      EXPECT_TRUE(conflicting) << "a wait for " << w << " that no conflict asks for";
    }
    if (check_minimal_) {
      // No redundant wait: none is implied by the stream's order so far and the other waits.
      for (size_t i = 0; i < result.waits.size(); ++i) {
        Clock others = base;
        for (size_t j = 0; j < result.waits.size(); ++j) {
          if (j != i) join_into(others, clock_of(result.waits[j]));
        }
        EXPECT_LT(others[producers[i]], result.waits[i].seq)
            << "redundant wait for " << result.waits[i] << " by stream " << ids_[s];
      }
    }
    Clock clock = base;
    for (const Position& w : result.waits) join_into(clock, clock_of(w));
    clock[s] = seq;
    ops_[s].push_back(clock);
    stream_clock_[s] = clock;
    waits_seen_ += result.waits.size();

    // Every conflicting pair (same storage, one writes, different streams) is ordered.
    for (const auto& a : accesses) {
      auto& history = history_[a.first];
      for (const Access& prev : history) {
        if (prev.stream == s || !(prev.write || a.second)) continue;
        ++conflicts_seen_;
        EXPECT_GE(clock[prev.stream], prev.seq)
            << "race on storage " << a.first << ": " << at(ids_[prev.stream], prev.seq)
            << (prev.write ? " (write)" : " (read)") << " is not ordered before "
            << at(ids_[s], seq) << (a.second ? " (write)" : " (read)");
      }
      history.push_back(Access{s, seq, a.second});
    }
  }

  void waited(size_t waiter, Position p) {
    tracker_.waited(ids_[waiter], p);
    if (p.seq > 0) join_into(stream_clock_[waiter], clock_of(p));
  }

  void completed(Position p) {
    tracker_.completed(p);
    if (p.seq > 0) join_into(host_, clock_of(p));
  }

  // Checks uses_off against the executor's history, then forgets the storage in both.
  void check_uses_off_and_forget(StorageId x, size_t home) {
    Clock home_clock = stream_clock_[home];
    join_into(home_clock, host_);
    std::map<StreamId, uint64_t> latest;
    for (const Access& a : history_[x]) {
      if (a.stream == home || home_clock[a.stream] >= a.seq) continue;
      uint64_t& l = latest[ids_[a.stream]];
      l = std::max(l, a.seq);
    }
    std::vector<Position> expected;
    for (const auto& l : latest) expected.push_back(at(l.first, l.second));
    EXPECT_EQ(tracker_.uses_off(x, ids_[home]), expected) << "storage " << x;
    tracker_.forget(x);
    history_.erase(x);
    EXPECT_EQ(tracker_.num_storages(), history_.size());
  }

  void check_is_ordered(size_t s, Position p) {
    Clock c = stream_clock_[s];
    join_into(c, host_);
    const size_t ps = index(p.stream);
    const bool expected = ps == s || c[ps] >= p.seq;
    EXPECT_EQ(tracker_.is_ordered(ids_[s], p), expected) << ids_[s] << " after " << p;
  }

  size_t num_storages() const { return history_.size(); }

 private:
  size_t index(StreamId id) const {
    return static_cast<size_t>(std::find(ids_.begin(), ids_.end(), id) - ids_.begin());
  }
  const Clock& clock_of(Position p) const { return ops_[index(p.stream)][p.seq - 1]; }

  std::vector<StreamId> ids_;
  DependencyTracker tracker_;
  bool check_minimal_;
  std::vector<std::vector<Clock>> ops_;  // per stream, per seq - 1: the op's clock
  std::vector<Clock> stream_clock_;      // per stream: what its next op is ordered after
  Clock host_;                           // what the host knows completed
  std::map<StorageId, std::vector<Access>> history_;
  uint64_t waits_seen_ = 0;
  uint64_t conflicts_seen_ = 0;
};

struct Workload {
  uint32_t seed;
  size_t streams;
  size_t ops;
  size_t history_limit;  // small: clocks of old positions are under-approximated
  bool check_minimal;    // only with an exact history
};

void run_workload(const Workload& w) {
  std::mt19937 rng(w.seed);
  auto uniform = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  // Sparse, unordered stream ids, as a runtime might assign them.
  const std::vector<StreamId> all_ids{17, -2, 3, 1000, 0, 5};
  std::vector<StreamId> ids(all_ids.begin(), all_ids.begin() + static_cast<long>(w.streams));
  Executor ex(ids, w.history_limit, w.check_minimal);
  constexpr size_t kStorages = 100, kHot = 12;
  auto storage = [&] {
    // Half of the accesses go to a few hot storages, so long dependency chains form.
    return static_cast<StorageId>(uniform(2) == 0 ? uniform(kHot) : uniform(kStorages));
  };
  auto recent = [&](size_t s) -> Position {
    const uint64_t n = ex.launched(s);
    const uint64_t back = std::min<uint64_t>(n, uniform(40));
    return at(ids[s], n - back);
  };
  for (size_t i = 0; i < w.ops; ++i) {
    const size_t roll = uniform(1000);
    if (roll < 20) {  // an external wait (wait_event / wait_pipeline / task start)
      ex.waited(uniform(ids.size()), recent(uniform(ids.size())));
    } else if (roll < 30) {  // a host synchronize
      ex.completed(recent(uniform(ids.size())));
    } else if (roll < 40) {  // a storage freed
      ex.check_uses_off_and_forget(storage(), uniform(ids.size()));
    } else if (roll < 60) {
      ex.check_is_ordered(uniform(ids.size()), recent(uniform(ids.size())));
    } else {
      std::vector<StorageId> reads, writes;
      const size_t nr = uniform(4), nw = uniform(3);
      for (size_t k = 0; k < nr; ++k) reads.push_back(storage());
      for (size_t k = 0; k < nw; ++k) writes.push_back(storage());
      ex.launch(uniform(ids.size()), reads, writes);
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
  // The workload exercised what it claims to.
  EXPECT_GT(ex.waits_seen(), w.ops / 20);
  EXPECT_GT(ex.conflicts_seen(), w.ops);
  EXPECT_EQ(ex.tracker().num_storages(), ex.num_storages());
  EXPECT_LE(ex.tracker().num_records(), ex.num_storages() * (1 + 2 * w.streams));
  EXPECT_LE(ex.tracker().num_history_entries(), w.history_limit * w.streams);
}

class RandomWorkload : public ::testing::TestWithParam<uint32_t> {};

}  // namespace

TEST_P(RandomWorkload, ConflictsAreOrderedAndNoWaitIsRedundant) {
  const uint32_t seed = GetParam();
  run_workload(Workload{seed, 4 + seed % 3, 4000, DependencyTracker::kDefaultHistoryLimit, true});
}

TEST_P(RandomWorkload, ATinyHistoryStaysSafe) {
  const uint32_t seed = GetParam();
  run_workload(Workload{seed + 1000, 4 + seed % 3, 4000, 1, false});
}

INSTANTIATE_TEST_SUITE_P(Seeds, RandomWorkload, ::testing::Range<uint32_t>(1, 9));

// ---------------------------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------------------------

TEST(DependencyTracker, ConcurrentLaunchesOnOwnStreamsOverSharedStorages) {
  constexpr int kThreads = 6;
  constexpr int kOpsPerThread = 10000;
  constexpr StorageId kShared = 24;
  DependencyTracker t;
  // The latest write position published per shared storage: stream in the high 16 bits.
  std::vector<std::atomic<uint64_t>> published(kShared);
  for (auto& p : published) p.store(0);
  auto pack = [](Position p) { return (static_cast<uint64_t>(p.stream) << 48) | p.seq; };
  auto unpack = [](uint64_t v) {
    return Position{static_cast<StreamId>(v >> 48), v & ((uint64_t{1} << 48) - 1)};
  };
  std::atomic<int> failures{0};
  std::atomic<uint64_t> waits{0};
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      const StreamId me = 10 + i;
      const StorageId own = 1000 + static_cast<StorageId>(i);  // private, freed now and then
      std::mt19937 rng(static_cast<uint32_t>(i) + 1);
      uint64_t seq = 0;
      // Start together, so the launches really interleave.
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      for (int k = 0; k < kOpsPerThread; ++k) {
        const StorageId x = rng() % kShared, y = rng() % kShared;
        const bool write = rng() % 3 == 0;
        // A write of x that launched before this launch (published after its launch returned).
        const Position seen = unpack(published[x].load(std::memory_order_acquire));
        const auto r = write ? t.launch(me, {y, own}, {x}) : t.launch(me, {x, y}, {own});
        if (r.position != Position{me, ++seq}) ++failures;
        for (const Position& w : r.waits) {
          if (w.stream == me || w.seq == 0) ++failures;
        }
        waits += r.waits.size();
        // Read or write after that write: ordered after it, whoever wrote x since.
        if (!t.is_ordered(me, seen)) ++failures;
        if (write) published[x].store(pack(r.position), std::memory_order_release);
        switch (rng() % 50) {
          case 0:
            t.completed(r.position);
            break;
          case 1:
            t.waited(me, unpack(published[y].load(std::memory_order_acquire)));
            break;
          case 2:
            t.uses_off(own, me);
            t.forget(own);
            break;
          case 3:
            t.num_storages();
            break;
          default:
            break;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(waits.load(), 0u);
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(t.num_launched(10 + i), uint64_t{kOpsPerThread});
}

// ---------------------------------------------------------------------------------------------
// Performance sanity
// ---------------------------------------------------------------------------------------------

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TP_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define TP_TEST_SANITIZED 1
#endif
#endif

TEST(DependencyTracker, HundredThousandLaunchesAreFast) {
  DependencyTracker t;
  std::mt19937 rng(7);
  constexpr int kLaunches = 100000;
  uint64_t waits = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kLaunches; ++i) {
    const StreamId s = static_cast<StreamId>(rng() % 4);
    const StorageId a = rng() % 1000, b = rng() % 1000, c = rng() % 1000;
    const auto r = (i % 2 == 0) ? t.launch(s, {a, b}, {c}) : t.launch(s, {a}, {b});
    waits += r.waits.size();
    if (i % 64 == 0) t.forget(rng() % 1000);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[ perf     ] " << kLaunches << " launches in " << seconds * 1e3 << " ms ("
            << seconds * 1e9 / kLaunches << " ns each, " << waits << " waits)\n";
  EXPECT_GT(waits, 0u);
#if defined(NDEBUG) && !defined(TP_TEST_SANITIZED)
  EXPECT_LT(seconds, 0.5);
#else
  EXPECT_LT(seconds, 30.0);  // instrumented or unoptimised build: only a sanity bound
#endif
}
