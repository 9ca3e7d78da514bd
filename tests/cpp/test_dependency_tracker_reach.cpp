// How far an inserted wait reaches on its producer's stream (DependencyTracker::launch's `cover`,
// waited()/completed()'s own_reach): when several threads launch on one stream, positions handed
// out in one order reach the stream in another, and an event recorded "now" covers the producer
// op but not a lower position another thread is still launching. The tracker must not credit
// the waiting stream (or the host) with that position.
#include "core/dependency_tracker.h"

#include <gtest/gtest.h>

#include <vector>

using torch_pipeline::core::DependencyTracker;
using torch_pipeline::core::Position;
using torch_pipeline::core::StorageId;
using torch_pipeline::core::StreamId;

namespace {

constexpr StreamId kDefault = 1, kP = 2, kQ = 3;
constexpr StorageId kA = 10, kB = 11;

Position at(StreamId stream, uint64_t seq) { return Position{stream, seq}; }

// Thread 1 writes A at default@1 (still launching); thread 2 writes B at default@2 (done).
void two_writers(DependencyTracker& t) {
  ASSERT_EQ(t.launch(kDefault, {}, {kA}).position, at(kDefault, 1));
  ASSERT_EQ(t.launch(kDefault, {}, {kB}).position, at(kDefault, 2));
}

}  // namespace

TEST(DependencyTrackerReach, AWaitReachingItsWholePrefixImpliesTheLowerPositions) {
  DependencyTracker t;
  two_writers(t);
  EXPECT_EQ(t.launch(kP, {kB}, {}).waits, std::vector<Position>{at(kDefault, 2)});
  EXPECT_TRUE(t.launch(kP, {kA}, {}).waits.empty());  // default@1 is below default@2
}

TEST(DependencyTrackerReach, APartialWaitDoesNotImplyAPositionStillLaunching) {
  DependencyTracker t;
  two_writers(t);
  std::vector<Position> asked;
  const auto launch = t.launch(kP, {kB}, {}, [&](const Position& w) {
    asked.push_back(w);
    return uint64_t{0};  // the event recorded now: default@1 is still being launched
  });
  EXPECT_EQ(launch.waits, std::vector<Position>{at(kDefault, 2)});
  EXPECT_EQ(asked, launch.waits);
  // Reading A on p must still wait for default@1.
  EXPECT_EQ(t.launch(kP, {kA}, {}).waits, std::vector<Position>{at(kDefault, 1)});
  EXPECT_FALSE(t.is_ordered(kP, at(kDefault, 2)));  // (an extra wait later: safe)
}

TEST(DependencyTrackerReach, APartialWaitKeepsTheProducersOtherOrderings) {
  DependencyTracker t;
  ASSERT_EQ(t.launch(kQ, {}, {kA}).position, at(kQ, 1));
  // default@1 reads A: it waits for q@1; then default@2 writes B.
  EXPECT_EQ(t.launch(kDefault, {kA}, {}).waits, std::vector<Position>{at(kQ, 1)});
  ASSERT_EQ(t.launch(kDefault, {}, {kB}).position, at(kDefault, 2));
  t.launch(kP, {kB}, {}, [](const Position&) { return uint64_t{0}; });
  // p is ordered after default@2's clock (q@1) although default@1 itself is not credited.
  EXPECT_TRUE(t.is_ordered(kP, at(kQ, 1)));
  EXPECT_FALSE(t.is_ordered(kP, at(kDefault, 1)));
}

TEST(DependencyTrackerReach, CompletedWithAPartialReachLeavesLowerPositionsToWaitFor) {
  DependencyTracker t;
  two_writers(t);
  t.completed(at(kDefault, 2), 0);
  EXPECT_EQ(t.launch(kP, {kA}, {}).waits, std::vector<Position>{at(kDefault, 1)});
  t.completed(at(kDefault, 2));  // the whole prefix
  EXPECT_TRUE(t.launch(kQ, {kA}, {}).waits.empty());
}

TEST(DependencyTrackerReach, WaitedWithAPartialReachLeavesLowerPositionsToWaitFor) {
  DependencyTracker t;
  two_writers(t);
  t.waited(kP, at(kDefault, 2), 0);
  EXPECT_EQ(t.launch(kP, {kA}, {}).waits, std::vector<Position>{at(kDefault, 1)});
  t.waited(kQ, at(kDefault, 2));
  EXPECT_TRUE(t.launch(kQ, {kA}, {}).waits.empty());
}
