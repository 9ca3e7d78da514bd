// The per-stream bookkeeping of the tracker: positions and events (core/stream_log.h) and the
// allocator-safety queue (core/keep_alive_queue.h).
#include "core/keep_alive_queue.h"
#include "core/stream_log.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

using torch_pipeline::core::KeepAliveQueue;
using torch_pipeline::core::StreamLog;

TEST(StreamLog, SettledStopsBelowPositionsStillLaunching) {
  StreamLog<int> log;
  EXPECT_EQ(log.settled(), 0u);
  log.start(1);
  log.start(2);
  log.start(3);
  EXPECT_EQ(log.launched(), 3u);
  EXPECT_EQ(log.settled(), 0u);
  log.finish(2);
  EXPECT_EQ(log.settled(), 0u);  // 1 is still launching
  log.finish(1);
  EXPECT_EQ(log.settled(), 2u);  // 3 is still launching
  log.finish(3);
  EXPECT_EQ(log.settled(), 3u);
  log.finish(42);  // unknown: ignored
  EXPECT_EQ(log.in_flight(), 0u);
  log.note_launched(4);  // a factory, seen at its end
  EXPECT_EQ(log.settled(), 4u);
}

TEST(StreamLog, LabelsDropBelowInFlightAndNeverRepeat) {
  StreamLog<int> log;
  log.start(1);
  log.finish(1);
  log.start(2);  // another thread still launching 2
  log.start(3);
  log.finish(3);
  EXPECT_EQ(log.label_for(3), 1u);  // an event now does not cover 2
  EXPECT_TRUE(log.keep(1, 10));
  EXPECT_EQ(log.label_for(3), 0u);  // nothing newer to record yet
  EXPECT_FALSE(log.keep(1, 11));    // labels ascend
  log.finish(2);
  EXPECT_EQ(log.label_for(3), 3u);
  EXPECT_EQ(log.label_for(0), 0u);
}

TEST(StreamLog, EventAtIsTheFirstKeptAtOrAfter) {
  StreamLog<std::string> log;
  for (uint64_t s = 1; s <= 9; ++s) {
    log.start(s);
    log.finish(s);
  }
  log.keep(3, "e3");
  log.keep(7, "e7");
  ASSERT_NE(log.event_at(1), nullptr);
  EXPECT_EQ(log.event_at(1)->second, "e3");
  EXPECT_EQ(log.event_at(3)->second, "e3");
  EXPECT_EQ(log.event_at(4)->second, "e7");
  EXPECT_EQ(log.event_at(8), nullptr);
  EXPECT_EQ(log.newest()->first, 7u);
}

TEST(StreamLog, KeepsABoundedNumberAndHandsTheOldestBack) {
  StreamLog<std::shared_ptr<int>> log(4);
  for (uint64_t s = 1; s <= 10; ++s) {
    log.start(s);
    log.finish(s);
    auto dropped = log.make_room();
    if (s > 4) {
      ASSERT_TRUE(dropped.has_value());
      EXPECT_EQ(**dropped, static_cast<int>(s) - 4);  // reusable by the caller
    } else {
      EXPECT_FALSE(dropped.has_value());
    }
    log.keep(s, std::make_shared<int>(static_cast<int>(s)));
    EXPECT_LE(log.events(), 4u);
  }
  EXPECT_EQ(log.event_at(1)->first, 7u);  // older ones dropped: the first kept over-waits
}

TEST(KeepAliveQueue, ReleasesInPositionOrderOnceComplete) {
  KeepAliveQueue<std::string> q;
  q.add(5, "b");
  q.add(2, "a");  // threads finish out of order
  q.add(9, "c");
  EXPECT_EQ(q.front_seq(), 2u);
  EXPECT_EQ(q.back_seq(), 9u);
  std::vector<std::string> out;
  EXPECT_EQ(q.take_done(out), 0u);
  q.completed(5);
  EXPECT_EQ(q.take_done(out), 2u);
  EXPECT_EQ(out, (std::vector<std::string>{"a", "b"}));
  q.completed(3);  // never goes back
  EXPECT_EQ(q.complete(), 5u);
  std::vector<uint64_t> seqs;
  EXPECT_EQ(q.take_all(out, [&](uint64_t s, std::string&) { seqs.push_back(s); }), 1u);
  EXPECT_EQ(seqs, std::vector<uint64_t>{9});
  EXPECT_TRUE(q.empty());
}

TEST(KeepAliveQueue, TakesTheItemsAPredicateLetsGoAnywhereUpToAPosition) {
  KeepAliveQueue<std::string> q;
  q.add(2, "a");
  q.add(4, "b");
  q.add(6, "c");
  q.add(8, "d");
  std::vector<std::string> out;
  std::vector<uint64_t> asked;
  // Only up to position 6, and only what the predicate lets go: "a" stays ahead of them.
  EXPECT_EQ(q.take_if(
                6,
                [&](uint64_t s, const std::string& x) {
                  asked.push_back(s);
                  return x != "a";
                },
                out),
            2u);
  EXPECT_EQ(asked, (std::vector<uint64_t>{2, 4, 6}));
  EXPECT_EQ(out, (std::vector<std::string>{"b", "c"}));
  EXPECT_EQ(q.size(), 2u);
  EXPECT_EQ(q.front_seq(), 2u);
  EXPECT_EQ(q.back_seq(), 8u);
  EXPECT_EQ(q.take_if(100, [](uint64_t, const std::string&) { return false; }, out), 0u);
  q.completed(8);
  out.clear();
  EXPECT_EQ(q.take_done(out), 2u);  // the rest, still in order
  EXPECT_EQ(out, (std::vector<std::string>{"a", "d"}));
}

TEST(KeepAliveQueue, ThrottlesQueriesOfTheSameLabel) {
  KeepAliveQueue<int> q;
  EXPECT_TRUE(q.due(4));
  int skipped = 0;
  while (!q.due(4)) {
    ++skipped;
  }
  EXPECT_EQ(skipped, static_cast<int>(KeepAliveQueue<int>::kRequery) - 1);
  EXPECT_TRUE(q.due(6));  // a new label is queried at once
}
