#include "race_checker.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <utility>

namespace torch_pipeline {
namespace core {

namespace {

static_assert(std::numeric_limits<uintptr_t>::digits <= 64,
              "length classes assume <= 64-bit addresses");

// k such that 2^k <= length < 2^(k+1); length > 0.
int length_class(uintptr_t length) {
  int k = 0;
  while (length >>= 1) ++k;
  return k;
}

std::string hex(uintptr_t value) {
  char buffer[2 + 2 * sizeof(uintptr_t) + 1];
  std::snprintf(buffer, sizeof(buffer), "0x%llx", static_cast<unsigned long long>(value));
  return buffer;
}

const char* kind(bool write) { return write ? "write" : "read"; }

}  // namespace

std::string Race::to_string() const {
  return "race on " + memory + " bytes [" + hex(begin) + ", " + hex(end) +
         "): " + kind(later_write) + " by " + later_op + " on " + later_timeline +
         " is not ordered after " + kind(earlier_write) + " by " + earlier_op + " on " +
         earlier_timeline;
}

RaceChecker::RaceChecker() {
  labels_.emplace_back("host");
  clocks_.emplace_back(1, 0);
}

Timeline RaceChecker::add_timeline(std::string label) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (labels_.size() >= static_cast<size_t>(std::numeric_limits<Timeline>::max())) {
    throw std::length_error("torch_pipeline: too many sim timelines");
  }
  labels_.push_back(std::move(label));
  clocks_.emplace_back(labels_.size(), 0);
  return static_cast<Timeline>(labels_.size() - 1);
}

const std::string& RaceChecker::label(Timeline t) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_timeline(t);
  // Elements of a deque do not move when others are appended, and labels never change.
  return labels_[static_cast<size_t>(t)];
}

void RaceChecker::check_timeline(Timeline t) const {
  if (t < 0 || static_cast<size_t>(t) >= labels_.size()) {
    throw std::out_of_range("torch_pipeline: unknown sim timeline " + std::to_string(t));
  }
}

bool RaceChecker::ordered_before(const Record& r, Timeline t) const {
  return r.timeline == t || clock_entry(clocks_[static_cast<size_t>(t)], r.timeline) >= r.epoch;
}

std::vector<RaceChecker::Hit> RaceChecker::overlapping(uintptr_t begin, uintptr_t end) {
  std::vector<Hit> hits;
  for (int k = 0; k < kLengthClasses; ++k) {
    Bucket& bucket = history_[static_cast<size_t>(k)];
    if (bucket.empty()) continue;
    // A record of this class is shorter than 2^(k+1), so one ending after `begin` begins at or
    // after begin - (2^(k+1) - 1).
    const uintptr_t reach = k + 1 >= std::numeric_limits<uintptr_t>::digits
                                ? std::numeric_limits<uintptr_t>::max()
                                : (uintptr_t{1} << (k + 1)) - 1;
    const uintptr_t low = begin > reach ? begin - reach : 0;
    for (auto it = bucket.lower_bound(low); it != bucket.end() && it->first < end; ++it) {
      if (it->second.end > begin) hits.push_back(Hit{k, it});
    }
  }
  return hits;
}

void RaceChecker::insert(Record r) {
  const int k = length_class(r.end - r.begin);
  const uintptr_t key = r.begin;
  history_[static_cast<size_t>(k)].emplace(key, std::move(r));
  ++history_count_;
}

void RaceChecker::erase(const Hit& hit) {
  history_[static_cast<size_t>(hit.bucket)].erase(hit.it);
  --history_count_;
}

std::vector<Race> RaceChecker::record_op(Timeline t, const std::string& op,
                                         const std::vector<Access>& accesses, Site site) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_timeline(t);
  for (const Access& a : accesses) {
    if (a.begin > a.end) {
      throw std::invalid_argument("torch_pipeline: sim access of " + op + " has begin " +
                                  hex(a.begin) + " after end " + hex(a.end));
    }
  }

  // Join the host clock, then start a new epoch of t.
  VectorClock& clock = clocks_[static_cast<size_t>(t)];
  const VectorClock& host = clocks_[static_cast<size_t>(kHost)];
  if (clock.size() < labels_.size()) clock.resize(labels_.size(), 0);
  if (t != kHost) {
    for (size_t i = 0; i < host.size(); ++i) clock[i] = std::max(clock[i], host[i]);
  }
  const uint64_t epoch = ++clock[static_cast<size_t>(t)];

  // Check every access against the history before recording any of them, so accesses of this op
  // never meet each other. One race per (earlier record, overlapping range): an op that reads and
  // writes the same bytes reports the pair once, as a write.
  std::vector<Race> found;
  std::map<std::tuple<const Record*, uintptr_t, uintptr_t>, size_t> seen;
  for (const Access& a : accesses) {
    if (a.begin == a.end) continue;
    for (const Hit& hit : overlapping(a.begin, a.end)) {
      const Record& r = hit.it->second;
      if (!(a.write || r.write) || ordered_before(r, t)) continue;
      const uintptr_t begin = std::max(a.begin, r.begin);
      const uintptr_t end = std::min(a.end, r.end);
      const auto inserted = seen.emplace(std::make_tuple(&r, begin, end), found.size());
      if (!inserted.second) {
        found[inserted.first->second].later_write |= a.write;
        continue;
      }
      Race race;
      race.memory = a.memory;
      race.begin = begin;
      race.end = end;
      race.earlier_op = r.op;
      race.earlier_timeline = labels_[static_cast<size_t>(r.timeline)];
      race.earlier_write = r.write;
      race.later_op = op;
      race.later_timeline = labels_[static_cast<size_t>(t)];
      race.later_write = a.write;
      race.earlier_site = r.site;
      race.later_site = site;
      found.push_back(std::move(race));
    }
  }

  // Record the accesses, pruning what each one makes redundant: a record that the new access
  // fully covers and that is ordered before it, where the new access writes or both read. Any later
  // access that would race with the pruned record races with the new one too (the pruned record
  // happens before it, it conflicts with whatever conflicted with the pruned one, and a later
  // access on its own timeline is ordered after both), so the ops reported as racing are unchanged;
  // only the earlier op named in a report may be the newer one.
  for (const Access& a : accesses) {
    if (a.begin == a.end) continue;
    for (const Hit& hit : overlapping(a.begin, a.end)) {
      const Record& r = hit.it->second;
      if (r.begin >= a.begin && r.end <= a.end && (a.write || !r.write) && ordered_before(r, t)) {
        erase(hit);
      }
    }
    insert(Record{a.begin, a.end, t, epoch, a.write, op, site});
  }

  races_.insert(races_.end(), found.begin(), found.end());
  return found;
}

VectorClock RaceChecker::snapshot(Timeline t) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_timeline(t);
  VectorClock clock = clocks_[static_cast<size_t>(t)];
  clock.resize(labels_.size(), 0);
  return clock;
}

void RaceChecker::join(Timeline into, const VectorClock& clock) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_timeline(into);
  if (clock.size() > labels_.size()) {
    throw std::invalid_argument("torch_pipeline: vector clock of " + std::to_string(clock.size()) +
                                " entries joined into a checker of " +
                                std::to_string(labels_.size()) + " timelines");
  }
  VectorClock& target = clocks_[static_cast<size_t>(into)];
  if (target.size() < clock.size()) target.resize(clock.size(), 0);
  for (size_t i = 0; i < clock.size(); ++i) target[i] = std::max(target[i], clock[i]);
}

void RaceChecker::join_timeline(Timeline into, Timeline from) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_timeline(into);
  check_timeline(from);
  if (into == from) return;
  const VectorClock& source = clocks_[static_cast<size_t>(from)];
  VectorClock& target = clocks_[static_cast<size_t>(into)];
  if (target.size() < source.size()) target.resize(source.size(), 0);
  for (size_t i = 0; i < source.size(); ++i) target[i] = std::max(target[i], source[i]);
}

template <class Drop>
void RaceChecker::remove_locked(uintptr_t begin, uintptr_t end, Drop drop) {
  if (begin >= end) return;
  // Partially overlapping records are trimmed: their bytes outside [begin, end) stay in history.
  // (The trimmed parts lie outside the range, so no hit of this loop is one of them.)
  for (const Hit& hit : overlapping(begin, end)) {
    if (!drop(hit.it->second)) continue;
    Record r = std::move(hit.it->second);
    erase(hit);
    if (r.begin < begin) {
      Record left = r;
      left.end = begin;
      insert(std::move(left));
    }
    if (r.end > end) {
      r.begin = end;
      insert(std::move(r));
    }
  }
}

void RaceChecker::forget(uintptr_t begin, uintptr_t end) {
  std::lock_guard<std::mutex> lock(mutex_);
  remove_locked(begin, end, [](const Record&) { return true; });
}

void RaceChecker::release(uintptr_t begin, uintptr_t end, const VectorClock& completed) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (completed.size() > labels_.size()) {
    throw std::invalid_argument("torch_pipeline: vector clock of " +
                                std::to_string(completed.size()) +
                                " entries released into a "
                                "checker of " +
                                std::to_string(labels_.size()) + " timelines");
  }
  remove_locked(begin, end,
                [&](const Record& r) { return clock_entry(completed, r.timeline) >= r.epoch; });
}

std::vector<Race> RaceChecker::races() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return races_;
}

void RaceChecker::note_races(const std::vector<Race>& found) {
  std::lock_guard<std::mutex> lock(mutex_);
  races_.insert(races_.end(), found.begin(), found.end());
}

void RaceChecker::clear_races() {
  std::lock_guard<std::mutex> lock(mutex_);
  races_.clear();
}

size_t RaceChecker::history_size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return history_count_;
}

}  // namespace core
}  // namespace torch_pipeline
