// Internal to the tracker. The capture module (docs/design.md, "Graph capture"): binds
// core/capture_state.h to c10. A capture begun through the hooks (tracking.h: capture_prepare,
// capture_begun) is a TrackedCapture: a LiveState of its own, in which the ops captured into the
// graph get positions (they do not run now), so the waits the tracker inserts between them are
// captured event record + wait edges, and nothing waits for work outside the capture (illegal
// there; replays are ordered instead). The capture's ledger names the streams that joined the
// capture and what the graph keeps alive. Owns the registry of captures, the thread's capture,
// and the test switch; the launch module asks it which state an op launches in. Callers of *_locked
// hold the capture's LiveState::mutex; a capture's lock may be held while the main state's is
// taken, never the other way round.
#pragma once

#include "state.h"
#include "storages.h"

#include "../../core/capture_state.h"
#include "../capture_probe.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// Strong: a tensor over the whole storage (kept alive, and the access of every replay, built
// once); Weak: the storage, not kept.
using GraphLedger = core::CaptureLedger<at::Tensor, c10::weak_intrusive_ptr<c10::StorageImpl>>;

// Periods of captures' states have this bit (with the capture id below it); the main state's never.
constexpr uint64_t kCapturePeriod = uint64_t{1} << 63;
inline bool is_capture_period(uint64_t period) { return (period & kCapturePeriod) != 0; }

struct TrackedCapture {
  TrackedCapture(core::CaptureId id, const c10::Stream& origin);
  const core::CaptureId id;
  const c10::Stream origin;
  std::atomic<bool> ended{false};   // capture_ended ran (on any thread)
  LiveState st;                     // positions inside the capture (st.period: kCapturePeriod | id)
  GraphLedger ledger;               // (under st.mutex)
  std::vector<std::string> errors;  // tracking errors inside the capture, raised at its end
                                    // (under st.mutex; the first few)
};
using TrackedCapturePtr = std::shared_ptr<TrackedCapture>;

// Whether captures are handled (the test switch; on by default).
bool capture_aware();

// The capture an op launching on the current streams of `devices` belongs to: nullptr for
// the main state (no capture involved). One atomic load and one thread-local read, with no device
// call, unless a capture begun through the hooks is underway (or this thread is about to begin
// one). A stream capturing into a capture not begun through the hooks is not supported (warned
// about once; the op is tracked in the main state). TORCH_CHECK error (also raised at the end of
// the thread's capture) for a stream of another capture than the thread's.
TrackedCapturePtr capture_for_launch(const std::vector<c10::Device>& devices);
// The capture of `period` (a capture period), if that capture is still underway.
TrackedCapturePtr capture_of_period(uint64_t period);
// The tracked capture `stream` captures into, among the registered ones; nullptr if none (at once,
// with no device call, while none is underway).
TrackedCapturePtr tracked_capture_of(const c10::Stream& stream);
// Whether this thread began a capture that is still underway (cheap: a thread-local read).
bool capturing_thread();

// A stream the capture's op launches on, seen in the capture for the first time: joins the ledger;
// one that is not capturing into this capture yet is forked into it first (it waits for an event
// recorded on the origin: a captured edge), after its eager work got an event in the main state.
// TORCH_CHECK error (also raised at the capture's end) for a device's default stream, which
// cannot join a capture (CUDA's legacy stream: cudaErrorStreamCaptureImplicit).
void join_capture_locked(TrackedCapture& w, StreamEntry& se);
// The captured op uses `storage` on `se`: noted in the ledger, and kept alive for the graph's
// lifetime when it was not born in the capture or is used off the stream it was born on.
void capture_use_locked(TrackedCapture& w, StreamEntry& se, const c10::Storage& storage,
                        bool write);
// A fresh output of a captured op on the capture's stream `home`: born in the capture, written by
// the graph (host memory, which a captured copy writes at every replay, is kept alive).
void capture_output_locked(TrackedCapture& w, const c10::Storage& storage, core::StreamId home);

// The capture target of a launch (Note [Launch targets], launch.cpp): the op is captured into the
// graph of `w`, in w's state.
class CaptureTarget {
 public:
  static constexpr bool kHomeUses = false;  // (every use goes to the ledger)
  explicit CaptureTarget(TrackedCapture& w) : w_(w) {}
  LiveState& state() { return w_.st; }
  void before_launch(std::vector<c10::Storage>&) {}  // (no event may be queried in a capture)
  void enter(StreamEntry& se) { join_capture_locked(w_, se); }
  void use(StorageEntry&, StreamEntry& se, const c10::Storage& storage, const Access& a, bool) {
    capture_use_locked(w_, se, storage, a.write);  // (perhaps kept for the graph's lifetime)
  }
  void launched(StreamEntry& se, const core::DependencyTracker::Launch& launch,
                std::vector<c10::Storage>&) {
    w_.ledger.launched(se.id, launch.position.seq);
  }
  void factory_launched(StreamEntry& se, uint64_t seq) { w_.ledger.launched(se.id, seq); }
  // (a storage's home only matters for keeping it alive, which a capture does not do: its ledger
  // keeps what the graph uses)
  void moved(const std::vector<at::Tensor>&, const std::vector<Launched>&) {}
  void output(const at::Tensor& out, Position definition) {
    capture_output_locked(w_, out.storage(), definition.stream);  // born in the graph
    if (!out.device().is_cpu()) {
      add_young_locked(w_.st, out.storage(), definition);
    }  // (host memory is not watched for a capture: the copy runs at replays)
  }

 private:
  TrackedCapture& w_;
};

// Whether the main state must not record an event on `stream` now: a capture is underway and
// `stream` captures into it (the event would be part of the graph, and a stream that waited for
// it would join the capture). One atomic load while no capture is underway.
bool captures_now(const c10::Stream& stream);

// A device query (an event query or synchronize) the tracker made in live period `period` failed:
// warns (once per period), saying what to do when a capture begun without the hooks is underway
// (the likely cause).
void explain_failed_query(const char* what, const c10::Error& e, uint64_t period);

// A tensor over the whole of `storage` (bytes), made without the dispatcher.
at::Tensor tensor_of(c10::Storage storage);

// In a forked child: no capture survives fork.
void reset_captures_after_fork();
// Captures registered now.
size_t captures_underway();

}  // namespace detail

// What each replay touches, built once when the capture ended (immutable, shared with the
// replays that are open).
struct GraphReplay::Touched {
  std::vector<at::Tensor> kept;          // over the storages kept for the graph's lifetime
  std::vector<detail::Access> accesses;  // over `kept`
  std::vector<detail::GraphLedger::Other> others;  // the rest, not kept (alive at the end)
  std::vector<c10::Device> devices;  // of `kept` (the replay enters them into the pipeline)
};

struct CapturedGraph::Impl {
  mutable std::mutex mutex;
  std::shared_ptr<const GraphReplay::Touched> touched;  // (under mutex) nullptr once reset
};

}  // namespace tracking
}  // namespace torch_pipeline
