// Plain C++17 (no torch includes): the automatic-synchronization tracker (docs/design.md,
// "Automatic synchronization") over abstract stream and storage ids. The runtime maps c10 streams
// and storages to these ids, asks the tracker before every op which waits to insert, and reports
// the waits it inserts itself and the completions the host observes. Thread-safe (one mutex).
//
// Model
// -----
// Every op launched on a stream gets a Position (stream, seq): seq counts the stream's ops from 1
// and only grows, so a Position names one op forever. Nothing is pooled or recycled here, so a
// reused storage id (after forget()) or a recycled event can never make a stale Position alias a
// new op: the event-pool-reuse bug of MXNet's engine, where a recycled event was taken for the op
// it used to stand for. A runtime that pools device events keys them by Position (the generation
// check) and recycles one only once its position is known complete.
//
// Ordering is tracked with vector clocks, so transitive orderings count:
//   - program order: an op is ordered after every earlier op of its stream;
//   - the waits launch() returns (the caller must insert them) and the external waits reported by
//     waited(): the waiting stream's later ops are ordered after the producer op and after
//     everything that op was ordered after;
//   - host completions reported by completed(): every op launched afterwards, on any stream, is
//     ordered after the completed op and everything it was ordered after. (The sim device joins
//     the host clock into a stream at its next launch; the tracker keeps one host clock and
//     consults it directly, which is the same since the host clock only grows.)
//
// Memory is bounded (streams are few and reused by the runtime; their state lives as long as the
// tracker). Per storage the tracker keeps the last writer and the readers since that
// write (at most one per stream: the latest), plus, for allocator safety, the latest use per
// stream since the storage was last forgotten; each record shares its stream's clock snapshot.
// Per stream it keeps a vector clock (what its next op is ordered after) and a history of at most
// `history_limit` clock changes, to look up the clock of a past position named by waited() or
// completed().
//
// Rules (docs/design.md, "The rules" and "Deduplication")
// --------------------------------------------------------
//   - read after write: an op reading a storage on S waits for the storage's last writer;
//   - write after read / write: an op writing a storage on S waits for the last writer and for
//     every reader since that write;
// and each of those waits is dropped when it is already implied: a producer on S itself (program
// order), a producer position S is already ordered after (earlier wait, waited(), completed(),
// transitively), or a producer position implied by another wait of the same launch. What is left
// is at most one wait per producer stream (its latest needed position) and no wait that the
// others imply: the minimal set, in any insertion order.
//
// Clocks of ops the tracker itself records (last writers, readers) are exact. Clocks of past
// positions named by waited()/completed() come from the per-stream history, which keeps the last
// `history_limit` clock changes of each stream (and drops changes the host clock already covers).
// A position older than that is treated as ordered after nothing but its own stream's earlier ops:
// an under-approximation, so it can only cause an extra wait later, never a missing one.
#pragma once

#include "small_vector.h"

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <iosfwd>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace torch_pipeline {
namespace core {

using StreamId = int64_t;    // abstract stream id (the runtime maps c10 streams to these)
using StorageId = uint64_t;  // abstract storage id

// The seq-th op (1-based) launched on `stream`. seq 0 names "before the stream's first op" and is
// trivially complete: waiting for it or reporting it completed does nothing.
struct Position {
  StreamId stream = 0;
  uint64_t seq = 0;
};
bool operator==(const Position& a, const Position& b);
bool operator!=(const Position& a, const Position& b);
std::ostream& operator<<(std::ostream& os, const Position& p);  // "stream 3 @ 17"

class DependencyTracker {
 public:
  static constexpr size_t kDefaultHistoryLimit = 1024;

  struct Launch {
    std::vector<Position> waits;  // to insert before the op, one per producer stream, by stream id
    Position position;            // the position the op gets
  };

  // Who serialises the calls: the tracker's own lock (every method is thread-safe), or the
  // caller, who holds a lock of its own around every call (the runtime's LiveState does: one
  // lock per op instead of two).
  enum class Locking { kInternal, kByCaller };

  // history_limit: clock changes kept per stream for waited()/completed() on past positions
  // (at least 1).
  explicit DependencyTracker(size_t history_limit = kDefaultHistoryLimit,
                             Locking locking = Locking::kInternal);
  ~DependencyTracker();

  DependencyTracker(const DependencyTracker&) = delete;
  DependencyTracker& operator=(const DependencyTracker&) = delete;

  // Before an op on `stream` that reads `reads` and writes `writes` (a storage in both counts as
  // written; duplicates are ignored). Returns the positions `stream` must wait for first (see
  // Rules) and the position this op gets. The caller inserts the waits (e.g. event waits on the
  // producers' recorded events), launches the op, and records an event at `position` if it may be
  // waited for. The tracker assumes the waits are inserted: later ops of `stream` count as ordered
  // after them. (Waiting for a later position of a producer stream than the one returned is safe:
  // the tracker then under-estimates the ordering, which costs at most an extra wait later.)
  // Streams are known from their first use.
  //
  // Several threads may launch on one stream at once, so positions handed out in one order can
  // reach the stream in another: an event recorded on a stream now covers every op enqueued there
  // so far, but not a lower position another thread is still launching. `cover`, if given, is
  // called (under the tracker's lock: it must not call the tracker) for each returned wait with
  // its position and returns how far the inserted wait reaches on the producer's own stream: the
  // producer op itself and its clock are covered, and positions of that stream up to the returned
  // seq (<= the wait's seq). The waiting stream is credited with no more than that, so a later op
  // waits again rather than assuming an op that was still launching elsewhere. Without `cover`,
  // every wait reaches its whole prefix.
  using Cover = std::function<uint64_t(const Position& wait)>;
  Launch launch(StreamId stream, const std::vector<StorageId>& reads,
                const std::vector<StorageId>& writes, const Cover& cover = nullptr);

  // The op at `p` (launched, typically just now) created `storages` (its fresh outputs: memory
  // nothing else used since it was allocated): each gets `p` as its last writer and no readers or
  // other uses, replacing whatever state a recycled id still had. No wait is involved: fresh memory
  // is kept from reuse by the allocator, not by the tracker. Throws std::invalid_argument if `p`
  // has not been launched yet.
  void define(Position p, const std::vector<StorageId>& storages);

  // The op at `p` (launched) read or wrote (`write`) storage `s`, told after the fact: recorded as
  // launch() would have recorded it (writer, readers, use), with p's clock from the history (or
  // none, beyond the history limit: ordered after nothing but its own stream, which can only add
  // a wait later). The runtime defers the uses of a storage on the stream that made it until
  // another stream uses it (Note [Home-stream uses]); it tells them here, after define(), oldest
  // first. Throws std::invalid_argument if `p` has not been launched yet.
  void used(Position p, StorageId s, bool write);

  // An external wait the runtime inserted (user wait_event / wait_pipeline, a task's streams
  // waiting for the submitter): the next ops of `waiter` are ordered after `producer`.
  // Throws std::invalid_argument if `producer` has not been launched yet.
  // `own_reach`: how far the wait reaches on the producer's own stream (see launch()'s `cover`;
  // UINT64_MAX: the whole prefix up to `producer`).
  void waited(StreamId waiter, Position producer, uint64_t own_reach = UINT64_MAX);

  // The host knows `p` completed (stream / event synchronize, a query that returned true): every
  // op launched from now on, on any stream, is ordered after `p` and after what `p` was ordered
  // after. Throws std::invalid_argument if `p` has not been launched yet.
  // `own_reach` as for waited(): the host saw p complete, but only positions of p's stream up to
  // own_reach are known complete with it (an event recorded while a lower position was still
  // being launched by another thread does not cover that one).
  void completed(Position p, uint64_t own_reach = UINT64_MAX);

  // Would an op launched on `stream` now be ordered after `p` without further waits?
  // (p on `stream` itself: true once launched. seq 0: true.)
  bool is_ordered(StreamId stream, Position p) const;

  // The storage was freed: drop its state. Unknown ids are ignored.
  void forget(StorageId s);
  void forget(const std::vector<StorageId>& storages);  // several at once (one lock)

  // Allocator safety (record_stream semantics): the latest use (read or write) per stream other
  // than `home` of `s` since it was last forgotten, leaving out the uses that an op launched on
  // `home` now is already ordered after (they cannot race with a reuse of the memory on `home`).
  // Sorted by stream id. Empty for an unknown storage.
  std::vector<Position> uses_off(StorageId s, StreamId home) const;

  // Ops launched on `stream` so far (its latest seq); 0 for a stream never used.
  uint64_t num_launched(StreamId stream) const;
  // Storages with tracked state (used and not forgotten since).
  size_t num_storages() const;
  // Memory accounting, for tests and monitoring: records held for all storages (last writers,
  // readers, uses; at most 1 + 2 * streams per storage), and clock-history entries of all streams
  // (at most history_limit per stream).
  size_t num_records() const;
  size_t num_history_entries() const;

 private:
  using Clock = std::vector<uint64_t>;  // indexed by dense stream index; missing entries are 0
  using ClockPtr = std::shared_ptr<const Clock>;

  // A launched op: its dense stream index, seq, and the clock of its stream when it was launched
  // (shared by all consecutive ops of a stream with the same clock; the entry for its own stream
  // is superseded by `seq`).
  struct Op {
    uint32_t stream = 0;
    uint64_t seq = 0;  // 0: none
    ClockPtr clock;
  };
  struct Use {
    uint32_t stream = 0;
    uint64_t seq = 0;
  };
  // (Readers and uses inline up to two streams: most storages see one or two, so their records
  // cost no allocation.)
  struct StorageState {
    Op writer;                   // seq 0 while the storage was never written (since forgotten)
    SmallVector<Op, 2> readers;  // since the last write, at most one per stream (the latest)
    SmallVector<Use, 2> uses;    // since forgotten, at most one per stream (the latest)
  };
  struct HistoryEntry {
    uint64_t
        first_seq;  // the clock holds for ops first_seq, first_seq + 1, ... up to the next entry
    ClockPtr clock;
  };
  struct StreamState {
    StreamId id = 0;
    uint64_t seq = 0;           // ops launched so far
    Clock clock;                // what the next op is ordered after (own entry: seq)
    bool clock_changed = true;  // clock differs from history.back()
    std::deque<HistoryEntry> history;
  };
  // A position's clock: `base` (may be null: nothing), with the own entry raised to `seq`.
  struct ClockView {
    const Clock* base = nullptr;
    uint32_t stream = 0;
    uint64_t seq = 0;
    uint64_t at(uint32_t i) const;
  };
  struct Need {
    uint64_t seq = 0;  // 0: no wait needed on this producer stream
    ClockPtr clock;
  };

  static uint64_t entry(const Clock& c, uint32_t i) { return i < c.size() ? c[i] : 0; }
  static bool join(Clock& into, const ClockView& v);  // true if `into` grew
  // join(), with the own entry of the view's stream capped at `own_reach`.
  static bool join_capped(Clock& into, const ClockView& v, uint64_t own_reach);

  uint32_t index_of(StreamId id);  // creates the stream's state on first use
  // The next op on stream `self` (whose state is `st`): its seq, with the clock's history updated.
  uint64_t advance(uint32_t self, StreamState& st);
  const StreamState* find_stream(StreamId id) const;
  uint32_t checked_index(const Position& p, const char* what);  // validates p.seq > 0 positions
  ClockView clock_at(uint32_t stream, uint64_t seq) const;      // from history
  Op op_at(uint32_t stream, uint64_t seq) const;                // same, as a shared snapshot
  void prune_history(uint32_t stream);
  bool covered(const StreamState& st, uint32_t stream, uint64_t seq) const;
  void consider(uint32_t self, const StreamState& st, const Op& op);

  std::unique_lock<std::mutex> guard() const;  // mutex_ locked, unless the caller serialises

  mutable std::mutex mutex_;
  const size_t history_limit_;
  const Locking locking_;
  std::vector<StreamState> streams_;
  // index_of's last answer (streams are never removed: an index stays valid); `last_id_` 0: none.
  StreamId last_id_ = 0;
  uint32_t last_index_ = 0;
  std::unordered_map<StreamId, uint32_t> stream_index_;
  Clock host_;  // what the host knows completed
  std::unordered_map<StorageId, StorageState> storages_;
  // Scratch space for launch(), guarded by mutex_.
  std::vector<Need> needs_;
  std::vector<uint32_t> needed_;
  std::vector<StorageId> reads_, writes_;
  std::vector<StorageState*> read_states_, write_states_;
};

}  // namespace core
}  // namespace torch_pipeline
