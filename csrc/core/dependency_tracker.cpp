#include "dependency_tracker.h"

#include <algorithm>
#include <ostream>
#include <stdexcept>
#include <string>

namespace torch_pipeline {
namespace core {

bool operator==(const Position& a, const Position& b) {
  return a.stream == b.stream && a.seq == b.seq;
}

bool operator!=(const Position& a, const Position& b) { return !(a == b); }

std::ostream& operator<<(std::ostream& os, const Position& p) {
  return os << "stream " << p.stream << " @ " << p.seq;
}

namespace {

bool join_plain(std::vector<uint64_t>& into, const std::vector<uint64_t>& from) {
  bool grew = false;
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i] > into[i]) {
      into[i] = from[i];
      grew = true;
    }
  }
  return grew;
}

}  // namespace

uint64_t DependencyTracker::ClockView::at(uint32_t i) const {
  if (i == stream) return seq;
  return base != nullptr ? entry(*base, i) : 0;
}

bool DependencyTracker::join(Clock& into, const ClockView& v) {
  bool grew = v.base != nullptr && join_plain(into, *v.base);
  if (into.size() <= v.stream) into.resize(static_cast<size_t>(v.stream) + 1, 0);
  // A snapshot's own entry is its first_seq <= v.seq: the view's own entry is v.seq.
  if (v.seq > into[v.stream]) {
    into[v.stream] = v.seq;
    grew = true;
  }
  return grew;
}

bool DependencyTracker::join_capped(Clock& into, const ClockView& v, uint64_t own_reach) {
  const uint64_t own = std::min(v.seq, own_reach);
  bool grew = false;
  if (v.base != nullptr) {
    const Clock& from = *v.base;
    if (into.size() < from.size()) into.resize(from.size(), 0);
    for (size_t i = 0; i < from.size(); ++i) {
      const uint64_t x = i == v.stream ? std::min(from[i], own) : from[i];
      if (x > into[i]) {
        into[i] = x;
        grew = true;
      }
    }
  }
  if (into.size() <= v.stream) into.resize(static_cast<size_t>(v.stream) + 1, 0);
  if (own > into[v.stream]) {
    into[v.stream] = own;
    grew = true;
  }
  return grew;
}

DependencyTracker::DependencyTracker(size_t history_limit, Locking locking)
    : history_limit_(std::max<size_t>(history_limit, 1)), locking_(locking) {}

std::unique_lock<std::mutex> DependencyTracker::guard() const {
  return locking_ == Locking::kInternal ? std::unique_lock<std::mutex>(mutex_)
                                        : std::unique_lock<std::mutex>();
}

DependencyTracker::~DependencyTracker() = default;

uint32_t DependencyTracker::index_of(StreamId id) {
  if (id == last_id_ && id != 0) return last_index_;
  const auto it = stream_index_.find(id);
  uint32_t index = 0;
  if (it != stream_index_.end()) {
    index = it->second;
  } else {
    index = static_cast<uint32_t>(streams_.size());
    streams_.emplace_back();
    streams_.back().id = id;
    stream_index_.emplace(id, index);
  }
  last_id_ = id;
  last_index_ = index;
  return index;
}

const DependencyTracker::StreamState* DependencyTracker::find_stream(StreamId id) const {
  const auto it = stream_index_.find(id);
  return it == stream_index_.end() ? nullptr : &streams_[it->second];
}

uint32_t DependencyTracker::checked_index(const Position& p, const char* what) {
  const auto it = stream_index_.find(p.stream);
  const uint64_t launched = it == stream_index_.end() ? 0 : streams_[it->second].seq;
  if (p.seq > launched || it == stream_index_.end()) {  // (callers handle seq 0 themselves)
    throw std::invalid_argument(std::string("torch_pipeline: ") + what + " names stream " +
                                std::to_string(p.stream) + " @ " + std::to_string(p.seq) +
                                ", but that stream has launched only " + std::to_string(launched) +
                                " ops");
  }
  return it->second;
}

DependencyTracker::Op DependencyTracker::op_at(uint32_t stream, uint64_t seq) const {
  Op op;
  op.stream = stream;
  op.seq = seq;
  const auto& history = streams_[stream].history;
  // The last entry whose first_seq <= seq. None: the entry was dropped (history_limit), and the
  // clock under-approximates with the stream's own program order only.
  auto it = std::upper_bound(history.begin(), history.end(), seq,
                             [](uint64_t s, const HistoryEntry& e) { return s < e.first_seq; });
  if (it != history.begin()) op.clock = std::prev(it)->clock;
  return op;
}

DependencyTracker::ClockView DependencyTracker::clock_at(uint32_t stream, uint64_t seq) const {
  // The snapshot stays alive in the history (clock_at's callers use it under the lock).
  const Op op = op_at(stream, seq);
  return ClockView{op.clock.get(), stream, seq};
}

void DependencyTracker::prune_history(uint32_t stream) {
  auto& history = streams_[stream].history;
  // Positions the host knows completed need no clock (the host clock covers them and what they
  // were ordered after): drop the entries that only cover such positions.
  const uint64_t done = entry(host_, stream);
  while (history.size() >= 2 && history[1].first_seq <= done + 1) history.pop_front();
  while (history.size() > history_limit_) history.pop_front();
}

bool DependencyTracker::covered(const StreamState& st, uint32_t stream, uint64_t seq) const {
  return entry(st.clock, stream) >= seq || entry(host_, stream) >= seq;
}

void DependencyTracker::consider(uint32_t self, const StreamState& st, const Op& op) {
  if (op.seq == 0 || op.stream == self) return;  // nothing, or program order
  if (covered(st, op.stream, op.seq)) return;    // already ordered after it
  Need& need = needs_[op.stream];
  if (need.seq == 0) needed_.push_back(op.stream);
  if (op.seq > need.seq) {  // the latest needed position of each producer stream
    need.seq = op.seq;
    need.clock = op.clock;
  }
}

uint64_t DependencyTracker::advance(uint32_t self, StreamState& st) {
  const uint64_t seq = ++st.seq;
  if (st.clock.size() <= self) st.clock.resize(static_cast<size_t>(self) + 1, 0);
  st.clock[self] = seq;
  if (st.clock_changed || st.history.empty()) {
    st.history.push_back(HistoryEntry{seq, std::make_shared<const Clock>(st.clock)});
    st.clock_changed = false;
    prune_history(self);
  }
  return seq;
}

DependencyTracker::Launch DependencyTracker::launch(StreamId stream,
                                                    const std::vector<StorageId>& reads,
                                                    const std::vector<StorageId>& writes,
                                                    const Cover& cover) {
  const auto lock = guard();
  const uint32_t self = index_of(stream);
  StreamState& st = streams_[self];
  if (reads.empty() && writes.empty()) {
    // (the common launch of an op whose storages all live on its stream: nothing to wait for)
    Launch result;
    result.position = Position{stream, advance(self, st)};
    return result;
  }

  // Normalise the access sets: sorted, unique, and a storage in both counts as written.
  writes_.assign(writes.begin(), writes.end());
  std::sort(writes_.begin(), writes_.end());
  writes_.erase(std::unique(writes_.begin(), writes_.end()), writes_.end());
  reads_.clear();
  for (const StorageId s : reads) {
    if (!std::binary_search(writes_.begin(), writes_.end(), s)) reads_.push_back(s);
  }
  std::sort(reads_.begin(), reads_.end());
  reads_.erase(std::unique(reads_.begin(), reads_.end()), reads_.end());

  // Collect the needed producers: the latest position per producer stream that `stream` is not
  // yet ordered after.
  if (needs_.size() < streams_.size()) needs_.resize(streams_.size());
  for (const uint32_t a : needed_) needs_[a] = Need{};  // left over only if a launch threw
  needed_.clear();
  // One lookup per storage (node references stay valid while others are inserted).
  write_states_.clear();
  read_states_.clear();
  for (const StorageId s : writes_) {
    StorageState& state = storages_[s];
    write_states_.push_back(&state);
    consider(self, st, state.writer);                         // write after write
    for (const Op& r : state.readers) consider(self, st, r);  // write after read
  }
  for (const StorageId s : reads_) {
    StorageState& state = storages_[s];
    read_states_.push_back(&state);
    consider(self, st, state.writer);  // read after write
  }

  // Keep the minimal set: drop a producer that another needed producer is ordered after.
  // (Implied through another wait's clock apart from its own stream's entry, which a partial
  // `cover` may not credit in full.)
  Launch result;
  for (const uint32_t a : needed_) {
    bool implied = false;
    for (const uint32_t b : needed_) {
      if (b == a) continue;
      const Clock* base = needs_[b].clock.get();
      if (base != nullptr && entry(*base, a) >= needs_[a].seq) {
        implied = true;
        break;
      }
    }
    if (!implied) result.waits.push_back(Position{streams_[a].id, needs_[a].seq});
  }
  // The caller inserts the waits: `stream` is ordered after them from now on, as far as each
  // reaches. The implied ones are below the kept ones' clocks: joining them adds nothing.
  for (const Position& w : result.waits) {
    const uint32_t a = stream_index_.at(w.stream);
    const uint64_t reach = cover ? cover(w) : w.seq;
    if (join_capped(st.clock, ClockView{needs_[a].clock.get(), a, needs_[a].seq}, reach)) {
      st.clock_changed = true;
    }
  }
  for (const uint32_t a : needed_) needs_[a] = Need{};
  needed_.clear();
  std::sort(result.waits.begin(), result.waits.end(),
            [](const Position& x, const Position& y) { return x.stream < y.stream; });

  // The op itself.
  const uint64_t seq = advance(self, st);
  const Op op{self, seq, st.history.back().clock};
  result.position = Position{stream, seq};

  auto note_use = [&](StorageState& state) {
    for (Use& u : state.uses) {
      if (u.stream == self) {
        u.seq = seq;
        return;
      }
    }
    state.uses.push_back(Use{self, seq});
  };
  for (StorageState* w : write_states_) {
    StorageState& state = *w;
    state.writer = op;
    state.readers.clear();
    note_use(state);
  }
  for (StorageState* r_state : read_states_) {
    StorageState& state = *r_state;
    bool replaced = false;
    for (Op& r : state.readers) {
      if (r.stream == self) {  // a later read on the same stream supersedes the earlier one
        r = op;
        replaced = true;
        break;
      }
    }
    if (!replaced) state.readers.push_back(op);
    note_use(state);
  }
  return result;
}

void DependencyTracker::define(Position p, const std::vector<StorageId>& storages) {
  const auto lock = guard();
  if (p.seq == 0) throw std::invalid_argument("torch_pipeline: define() needs a launched position");
  const uint32_t index = checked_index(p, "define()");
  const Op op = op_at(index, p.seq);
  for (const StorageId s : storages) {
    StorageState& state = storages_[s];
    state.writer = op;
    state.readers.clear();
    state.uses.clear();
    state.uses.push_back(Use{index, p.seq});
  }
}

void DependencyTracker::used(Position p, StorageId s, bool write) {
  const auto lock = guard();
  if (p.seq == 0) return;
  const uint32_t index = checked_index(p, "used()");
  const Op op = op_at(index, p.seq);
  StorageState& state = storages_[s];
  if (write) {
    state.writer = op;
    state.readers.clear();
  } else {
    bool replaced = false;
    for (Op& r : state.readers) {
      if (r.stream == index) {
        if (r.seq < op.seq) r = op;
        replaced = true;
        break;
      }
    }
    if (!replaced) state.readers.push_back(op);
  }
  for (Use& u : state.uses) {
    if (u.stream == index) {
      u.seq = std::max(u.seq, p.seq);
      return;
    }
  }
  state.uses.push_back(Use{index, p.seq});
}

void DependencyTracker::waited(StreamId waiter, Position producer, uint64_t own_reach) {
  const auto lock = guard();
  if (producer.seq == 0) return;
  const uint32_t from = checked_index(producer, "waited()");
  const uint32_t to = index_of(waiter);
  if (to == from) return;  // program order
  StreamState& st = streams_[to];
  if (covered(st, from, producer.seq)) return;
  if (join_capped(st.clock, clock_at(from, producer.seq), own_reach)) st.clock_changed = true;
}

void DependencyTracker::completed(Position p, uint64_t own_reach) {
  const auto lock = guard();
  if (p.seq == 0) return;
  const uint32_t index = checked_index(p, "completed()");
  if (entry(host_, index) >= p.seq) return;
  join_capped(host_, clock_at(index, p.seq), own_reach);
}

bool DependencyTracker::is_ordered(StreamId stream, Position p) const {
  const auto lock = guard();
  if (p.seq == 0) return true;
  const StreamState* producer = find_stream(p.stream);
  if (producer == nullptr || p.seq > producer->seq) return false;  // not launched yet
  if (p.stream == stream) return true;
  const uint32_t index = stream_index_.at(p.stream);
  if (entry(host_, index) >= p.seq) return true;
  const StreamState* st = find_stream(stream);
  return st != nullptr && entry(st->clock, index) >= p.seq;
}

void DependencyTracker::forget(StorageId s) {
  const auto lock = guard();
  storages_.erase(s);
}

void DependencyTracker::forget(const std::vector<StorageId>& storages) {
  const auto lock = guard();
  for (const StorageId s : storages) storages_.erase(s);
}

std::vector<Position> DependencyTracker::uses_off(StorageId s, StreamId home) const {
  const auto lock = guard();
  std::vector<Position> out;
  const auto it = storages_.find(s);
  if (it == storages_.end()) return out;
  const StreamState* st = find_stream(home);
  for (const Use& u : it->second.uses) {
    const StreamState& user = streams_[u.stream];
    if (user.id == home) continue;
    if (entry(host_, u.stream) >= u.seq) continue;
    if (st != nullptr && entry(st->clock, u.stream) >= u.seq) continue;
    out.push_back(Position{user.id, u.seq});
  }
  std::sort(out.begin(), out.end(),
            [](const Position& x, const Position& y) { return x.stream < y.stream; });
  return out;
}

uint64_t DependencyTracker::num_launched(StreamId stream) const {
  const auto lock = guard();
  const StreamState* st = find_stream(stream);
  return st == nullptr ? 0 : st->seq;
}

size_t DependencyTracker::num_storages() const {
  const auto lock = guard();
  return storages_.size();
}

size_t DependencyTracker::num_records() const {
  const auto lock = guard();
  size_t n = 0;
  for (const auto& s : storages_) {
    n += (s.second.writer.seq != 0 ? 1 : 0) + s.second.readers.size() + s.second.uses.size();
  }
  return n;
}

size_t DependencyTracker::num_history_entries() const {
  const auto lock = guard();
  size_t n = 0;
  for (const auto& st : streams_) n += st.history.size();
  return n;
}

}  // namespace core
}  // namespace torch_pipeline
