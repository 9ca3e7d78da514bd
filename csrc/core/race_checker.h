// Plain C++17 (no torch includes): the race checker of the sim device (csrc/sim; docs/design.md,
// "The race checker").
//
// Vector clocks over "timelines": the host (timeline 0) and every sim stream. Enqueueing an op on a
// stream joins the host clock into the stream's and starts a new epoch of the stream; recording an
// event captures a stream's clock (snapshot); waiting on an event joins that snapshot into the
// waiting stream; a host synchronize (stream, event, device) or a query that reports completion
// joins the stream's (or event's) clock into the host's.
//
// Every access of an op is a byte range of device memory (absolute addresses), read or write. An
// access conflicts with an earlier access of overlapping bytes when at least one of them writes;
// the pair races when the earlier one, made on another timeline at epoch e, is not ordered before
// the later one (the later timeline's clock entry for the earlier timeline is < e). Memory reuse
// is checked the same way: the allocator reports a reused block as a write of the whole block by
// the new owner's stream, so uses of the block's previous tensor that are not ordered before the
// reuse race with it (uses that record_stream() made the allocator wait for are released first:
// release() forgets them for that block only).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace core {

using Timeline = int32_t;
constexpr Timeline kHost = 0;

using VectorClock = std::vector<uint64_t>;  // indexed by Timeline; missing entries are 0

// clock[t], or 0 where the clock has no entry for t.
inline uint64_t clock_entry(const VectorClock& clock, Timeline t) {
  const auto i = static_cast<size_t>(t);
  return t >= 0 && i < clock.size() ? clock[i] : 0;
}

// Where an access was made (e.g. a captured Python stack), opaque to the checker: it keeps the
// site with the access's history record and hands both sites of a race to its reporter. Sites
// are only given in the report mode that asks for them (capturing one costs more than an op).
struct AccessSite {
  virtual ~AccessSite() = default;
};
using Site = std::shared_ptr<const AccessSite>;

struct Access {
  uintptr_t begin = 0;  // byte range [begin, end) of device memory
  uintptr_t end = 0;
  bool write = false;
  std::string memory;  // what the range is, for reports, e.g. "sim:0 storage 0x55d0c0 (64 bytes)"
};

struct Race {
  std::string memory;   // the later access's memory description
  uintptr_t begin = 0;  // overlapping byte range
  uintptr_t end = 0;
  std::string earlier_op;        // e.g. "aten::add.Tensor"
  std::string earlier_timeline;  // label of its timeline, e.g. "sim:0 stream 3"
  bool earlier_write = false;
  std::string later_op;
  std::string later_timeline;
  bool later_write = false;
  Site earlier_site;  // null unless the accesses were recorded with sites
  Site later_site;
  // One line naming both ops, their streams, read/write, and the memory.
  std::string to_string() const;
};

class RaceChecker {
 public:
  RaceChecker();  // the host timeline exists from the start, labelled "host"

  // A new timeline (a stream), e.g. label "sim:0 stream 5 (priority 0)". Ids are 1, 2, ...
  Timeline add_timeline(std::string label);
  const std::string& label(Timeline t) const;

  // An op enqueued on stream `t`: joins the host clock into t, starts a new epoch of t, checks
  // `accesses` against the history, then records them. Returns the races found (also kept in
  // races()). Accesses of one op never race with each other.
  // `site` (may be null) is where the op was called from, kept with its records for reports.
  std::vector<Race> record_op(Timeline t, const std::string& op,
                              const std::vector<Access>& accesses, Site site = nullptr);

  // The clock of `t` now (for an event recorded on t).
  VectorClock snapshot(Timeline t) const;
  // Joins `clock` into `into` (event wait: into = the waiting stream; event sync: into = kHost).
  void join(Timeline into, const VectorClock& clock);
  // Joins the clock of `from` into `into` (stream synchronize: into = kHost).
  void join_timeline(Timeline into, Timeline from);

  // Forget the history of [begin, end) (memory given back to the system, not to a cache). Records
  // that overlap the range only in part are trimmed to their bytes outside it (the history of
  // bytes outside [begin, end) is kept).
  void forget(uintptr_t begin, uintptr_t end);

  // Forget the records of [begin, end) that are ordered before `completed` (a clock the range's
  // later users are known to be ordered after for this range only, e.g. the uses of a freed block
  // that record_stream() named, complete when the allocator hands the block out again). Records
  // that overlap the range only in part keep their bytes outside it. Nothing else is ordered by
  // it: no timeline's clock changes.
  void release(uintptr_t begin, uintptr_t end, const VectorClock& completed);

  std::vector<Race> races() const;
  void clear_races();
  // Adds races found elsewhere (by a capture's own checker, sim/graph_capture.h) to races().
  void note_races(const std::vector<Race>& found);

  // fork(): the forking thread holds the checker's lock around fork(), so that the child (where
  // only that thread exists) finds it free and the history consistent. Nothing else in between.
  void lock_for_fork() const { mutex_.lock(); }
  void unlock_after_fork() const { mutex_.unlock(); }
  // Number of access records kept (for tests of pruning; bounded by the live conflicting state).
  size_t history_size() const;

 private:
  struct Record {
    uintptr_t begin, end;
    Timeline timeline;
    uint64_t epoch;
    bool write;
    std::string op;
    Site site;
  };
  // The history is split by length class: bucket k holds the records whose length is in
  // [2^k, 2^(k+1)), keyed by begin address. A record of bucket k that overlaps [b, e) begins in
  // (b - 2^(k+1), e), so an overlap lookup visits only nearby candidates of each bucket, however
  // long the records of other buckets are.
  static constexpr int kLengthClasses = 64;
  using Bucket = std::multimap<uintptr_t, Record>;
  struct Hit {
    int bucket;
    Bucket::iterator it;
  };

  void check_timeline(Timeline t) const;  // throws std::out_of_range; mutex_ held
  // Whether r is ordered before the current position of timeline t (mutex_ held).
  bool ordered_before(const Record& r, Timeline t) const;
  // The records overlapping [begin, end), begin < end (mutex_ held).
  std::vector<Hit> overlapping(uintptr_t begin, uintptr_t end);
  void insert(Record r);       // mutex_ held
  void erase(const Hit& hit);  // mutex_ held
  // Removes the records overlapping [begin, end) for which `drop` holds, keeping their bytes
  // outside the range (mutex_ held).
  template <class Drop>
  void remove_locked(uintptr_t begin, uintptr_t end, Drop drop);

  mutable std::mutex mutex_;
  std::deque<std::string> labels_;  // a deque: references from label() survive add_timeline()
  std::vector<VectorClock> clocks_;
  std::array<Bucket, kLengthClasses> history_;
  size_t history_count_ = 0;
  std::vector<Race> races_;
};

}  // namespace core
}  // namespace torch_pipeline
