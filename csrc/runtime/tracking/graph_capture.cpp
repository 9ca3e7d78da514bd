// The capture module (see capture.h and "Graph capture" in tracking.h): captures underway, each a
// state of its own; the hooks around a capture's begin and end; what a captured graph keeps (its
// replays are graph_replay.cpp's). Touches the captures' states it owns, the thread's capture, the
// query gate (capture.h of the runtime), and the main state only to give eager work its events
// before a stream captures.
#include "graph_capture.h"

#include "../context.h"
#include "../runtime.h"
#include "../warn.h"
#include "launch.h"
#include "life.h"
#include "scope.h"
#include "streams.h"

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <sstream>

namespace torch_pipeline {
namespace tracking {

struct CaptureHandle::Impl {
  detail::TrackedCapturePtr tracked;
};

namespace detail {
namespace {

constexpr size_t kMaxErrors = 8;  // errors a capture remembers

std::atomic<bool> g_aware{true};

// Leaked, like state(): ops may run at exit.
core::CaptureRegistry<TrackedCapture>* const g_registry =
    new core::CaptureRegistry<TrackedCapture>(query_gate());

// The capture this thread began, until it ends (on any thread: then it is dropped here lazily).
thread_local TrackedCapturePtr t_capture;
// Between capture_prepare() and capture_begun() / capture_abandoned(): the prepare's pause.
thread_local std::unique_ptr<core::QueryPause> t_prepared;

c10::Stream current_stream(const c10::Device& d) {
  return c10::impl::getDeviceGuardImpl(d.type())->getStream(d);
}

// This thread's capture, if it has not ended.
TrackedCapturePtr& thread_capture() {
  if (t_capture && t_capture->ended.load(std::memory_order_acquire)) {
    t_capture.reset();
  }
  return t_capture;
}

uintptr_t key_of(const c10::Storage& s) {
  return reinterpret_cast<uintptr_t>(s.unsafeGetStorageImpl());
}

TrackedCapturePtr make_capture(core::CaptureId id, const c10::Stream& origin) {
  count(&Counters::captures);
  return std::make_shared<TrackedCapture>(id, origin);
}

// Tracking failed inside the capture of `w`: raised again when it ends (the first few).
void note_error_locked(TrackedCapture& w, const std::string& message) {
  if (w.errors.size() < kMaxErrors &&
      std::find(w.errors.begin(), w.errors.end(), message) == w.errors.end()) {
    w.errors.push_back(message);
  }
}

[[noreturn]] void fail_in(TrackedCapture& w, const std::string& message, bool locked) {
  if (locked) {
    note_error_locked(w, message);
  } else {
    std::lock_guard<std::mutex> lock(w.st.mutex);
    note_error_locked(w, message);
  }
  TORCH_CHECK(false, message);
}

// The main state's eager work on `stream` so far gets an event, before the stream captures: a
// later eager waiter for it must find one kept (recording it once the stream captures would put
// it in the graph). Takes the main state's lock.
void record_eager_end(const c10::Stream& stream) {
  if (!live()) {
    return;
  }
  LiveState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  if (const StreamEntry* e = st.streams.find(stream)) {
    record_locked(st, e->id, e->log.settled());
  }
}

// The slow path of capture_for_launch (a capture is underway, or this thread is about to begin
// one).
TrackedCapturePtr find_capture(const std::vector<c10::Device>& devices) {
  TrackedCapturePtr& mine = thread_capture();
  for (const c10::Device& d : devices) {
    const c10::Stream stream = current_stream(d);
    const core::CaptureId id = capture_of(stream);
    switch (core::route_launch(mine ? mine->id : core::kNoCapture, id)) {
      case core::CaptureRoute::kEager:
        continue;
      case core::CaptureRoute::kFork:
        return mine;  // (join_capture_locked forks the stream in)
      case core::CaptureRoute::kMixed: {
        std::ostringstream msg;
        msg << "torch_pipeline: an op was launched on " << stream
            << ", which is capturing into another graph than the one this thread is capturing "
               "(on "
            << mine->origin
            << "). Capture one graph per thread, and do not use another thread's capturing "
               "stream.";
        fail_in(*mine, msg.str(), /*locked=*/false);
      }
      case core::CaptureRoute::kCaptured:
        if (mine && (id == mine->id || id == core::kUnknownCapture)) {
          return mine;
        }
        if (id == core::kUnknownCapture) {
          continue;  // an invalidated capture this thread did not begin: left to the device
        }
        if (TrackedCapturePtr w = g_registry->find(id)) {
          return w;  // another thread's capture (its stream, or one that joined it)
        }
        if (t_prepared && !mine) {
          // This thread's capture, begun by the device and not registered yet (capture_begun
          // finds it registered).
          mine = g_registry->add(id, [&] { return make_capture(id, stream); });
          return mine;
        }
        warn_once("capture without hooks",
                  "an op was launched on a stream that is capturing into a graph "
                  "that was not begun through torch.cuda.graph / CUDAGraph.capture_begin (e.g. "
                  "by an extension calling cudaStreamBeginCapture). That is not supported while "
                  "a pipeline is alive: the op is tracked as if it ran now (its waits for other "
                  "streams may fail the capture), and the tracker's event queries may fail it. "
                  "Capture through torch.cuda.graph (or CUDAGraph.capture_begin / capture_end, "
                  "torch.accelerator.Graph).");
        continue;
    }
  }
  return nullptr;
}

// Tracking may go idle now that a capture's pause ended (a pause keeps it live).
void idle_if_unwanted() {
  if (live()) {
    update_live(/*settle=*/false);
  }
}

}  // namespace

at::Tensor tensor_of(c10::Storage storage) {
  const c10::Device device = storage.device();
  const auto nbytes = static_cast<int64_t>(storage.nbytes());
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage),
      c10::DispatchKeySet(c10::computeDispatchKey(std::nullopt, c10::kStrided, device)),
      caffe2::TypeMeta::Make<uint8_t>());
  t.unsafeGetTensorImpl()->set_sizes_contiguous({nbytes});
  return t;
}

TrackedCapture::TrackedCapture(core::CaptureId i, const c10::Stream& o)
    : id(i), origin(o), ledger(i, /*origin's id in st*/ 1) {
  st.period = kCapturePeriod | (i & ~kCapturePeriod);
  const StreamEntry& e = st.streams.acquire(origin);  // (no baseline in a capture)
  TORCH_INTERNAL_ASSERT(e.id == 1, "the origin of a capture is its state's first stream");
}

bool capture_aware() { return g_aware.load(std::memory_order_relaxed); }

TrackedCapturePtr capture_for_launch(const std::vector<c10::Device>& devices) {
  if (g_registry->size() == 0 && !t_prepared) {
    return nullptr;  // (the op path: no capture begun through the hooks is underway)
  }
  if (!capture_aware()) {
    return nullptr;
  }
  return find_capture(devices);
}

TrackedCapturePtr capture_of_period(uint64_t period) {
  return g_registry->find(period & ~kCapturePeriod);
}

TrackedCapturePtr tracked_capture_of(const c10::Stream& stream) {
  if (g_registry->size() == 0 || !capture_aware()) {
    return nullptr;
  }
  const core::CaptureId id = capture_of(stream);
  if (id == core::kNoCapture) {
    return nullptr;
  }
  const TrackedCapturePtr& mine = thread_capture();
  if (mine && (id == core::kUnknownCapture || id == mine->id)) {
    return mine;
  }
  return id == core::kUnknownCapture ? nullptr : g_registry->find(id);
}

bool capturing_thread() { return t_capture && !t_capture->ended.load(std::memory_order_acquire); }

void join_capture_locked(TrackedCapture& w, StreamEntry& se) {
  if (w.ledger.joined(se.id)) {
    return;
  }
  if (capture_of(se.stream) != w.id) {
    const c10::Device device = se.stream.device();
    if (se.stream == c10::impl::getDeviceGuardImpl(device.type())->getDefaultStream(device)) {
      std::ostringstream msg;
      msg << "torch_pipeline: an op inside the graph capture on " << w.origin << " runs on "
          << se.stream << ", the default stream of " << device
          << ", which cannot join a capture (CUDA's legacy default stream is never captured: "
             "cudaErrorStreamCaptureImplicit). Run that device's work in a pipeline (with "
             "tp.pipeline(p): ...) or on a side stream inside the capture, or keep it out of "
             "the capture.";
      fail_in(w, msg.str(), /*locked=*/true);
    }
    // Not capturing into this capture: its eager work gets its event outside the capture, then it
    // is forked in (it waits for the origin's captured work so far; the event is recorded in the
    // capture, so the wait is a captured edge).
    record_eager_end(se.stream);
    StreamEntry& o = w.st.streams.at(w.ledger.origin());
    c10::Event fork(o.stream.device_type());
    fork.record(o.stream);
    fork.block(se.stream);
    count(&Counters::events);
    count(&Counters::waits);
    count(&Counters::capture_forks);
    if (const uint64_t settled = o.log.settled(); settled != 0) {
      w.st.tracker->waited(se.id, Position{o.id, settled});
    }
  }
  w.ledger.join(se.id);
}

void capture_use_locked(TrackedCapture& w, StreamEntry& se, const c10::Storage& storage,
                        bool write) {
  if (w.ledger.use(
          key_of(storage), se.id, write, [&] { return storage.getWeakStorageImpl(); },
          [&] { return tensor_of(storage); })) {
    count(&Counters::capture_kept);
  }
}

void capture_output_locked(TrackedCapture& w, const c10::Storage& storage, core::StreamId home) {
  // Host memory a captured copy writes is written at every replay: kept.
  if (w.ledger.born(
          key_of(storage), home, /*keep=*/storage.device().is_cpu(),
          [&] { return storage.getWeakStorageImpl(); }, [&] { return tensor_of(storage); })) {
    count(&Counters::capture_kept);
  }
}

bool captures_now(const c10::Stream& stream) {
  return query_gate().paused() > 0 && capture_aware() && capture_of(stream) != core::kNoCapture;
}

void explain_failed_query(const char* what, const c10::Error& e, uint64_t period) {
  static std::atomic<uint64_t> warned_period{0};
  if (warned_period.exchange(period) == period) {
    return;
  }
  warn(std::string(what) + " failed (" + e.what_without_backtrace() +
       "). If a graph capture that was not begun through torch.cuda.graph / "
       "CUDAGraph.capture_begin is underway (an extension calling "
       "cudaStreamBeginCapture directly, say), that is why: the tracker queries events "
       "to let go of memory it keeps alive and cannot know of such a capture, which the "
       "query fails (cudaErrorStreamCaptureUnsupported). Capturing that way is not "
       "supported while a pipeline is alive: capture through torch.cuda.graph (or "
       "CUDAGraph.capture_begin / capture_end, torch.accelerator.Graph), or with no "
       "pipeline alive. (Warned once per live period.)");
}

void reset_captures_after_fork() {
  g_registry->reset_after_fork();
  query_gate().reset_after_fork();
  if (t_capture) {
    new TrackedCapturePtr(
        std::move(t_capture));  // (leaked: its lock may be held by a thread now gone)
  }
  t_capture.reset();
  (void)t_prepared.release();  // (leaked: its gate was reset above)
}

size_t captures_underway() { return g_registry->size(); }

}  // namespace detail

// ---- the hooks around a capture's begin and end -------------------------------------------------

CaptureHandle::CaptureHandle(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CaptureHandle::~CaptureHandle() = default;

void capture_prepare(const c10::Stream& stream) {
  using namespace detail;
  if (!capture_aware()) {
    return;
  }
  TORCH_CHECK(!t_prepared && !thread_capture(),
              "torch_pipeline: this thread is already capturing a graph; a thread captures one "
              "graph at a time (end that capture first)");
  // Queries pause here, and the ones running now finish first. Until the capture is registered
  // the pause is the prepare's: released whatever fails from here on.
  auto pause = std::make_unique<core::QueryPause>(query_gate());
  if (live()) {
    // Outside the capture: the thread's run of ops ends here (its event is recorded now, so later
    // waits for it find it kept), and so does the eager work on the stream about to capture
    // (another thread's reader of it must not record its event inside the capture).
    LiveState& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    ThreadRun& run = thread_run();
    if (run.last.seq != 0 && run.last_period == st.period) {
      record_locked(st, run.last.stream, run.last.seq);
    }
    run.last = Position{};
    if (const StreamEntry* e = st.streams.find(stream)) {
      record_locked(st, e->id, e->log.settled());
    }
  }
  t_prepared = std::move(pause);
}

std::shared_ptr<CaptureHandle> capture_begun(const c10::Stream& stream) {
  using namespace detail;
  std::unique_ptr<core::QueryPause> prepared = std::move(t_prepared);
  if (!prepared) {
    return nullptr;
  }
  std::shared_ptr<CaptureHandle> handle;
  const core::CaptureId id = capture_of(stream);
  if (id != core::kNoCapture && id != core::kUnknownCapture) {
    TrackedCapturePtr w = g_registry->add(id, [&] { return make_capture(id, stream); });
    auto impl = std::make_unique<CaptureHandle::Impl>();
    impl->tracked = w;
    handle = std::make_shared<CaptureHandle>(std::move(impl));
    t_capture = std::move(w);
  }
  prepared.reset();  // (the registry holds its own pause while the capture is underway)
  if (!handle) {
    idle_if_unwanted();  // (a go-idle refused meanwhile)
  }
  return handle;
}

void capture_abandoned() {
  using namespace detail;
  if (t_prepared) {
    t_prepared.reset();
    idle_if_unwanted();
  }
}

size_t capture_join_back(const CaptureHandle* capture) {
  using namespace detail;
  if (capture == nullptr) {
    return 0;
  }
  TrackedCapture& w = *capture->impl().tracked;
  std::lock_guard<std::mutex> lock(w.st.mutex);
  const StreamId origin = w.ledger.origin();
  const auto unjoined = w.ledger.unjoined(
      [&](StreamId a, const Position& p) { return w.st.tracker->is_ordered(a, p); });
  for (const StreamId s : unjoined) {
    StreamEntry& e = w.st.streams.at(s);
    // Joined now, so the device can end the capture (a captured edge).
    c10::Event join(e.stream.device_type());
    join.record(e.stream);
    join.block(w.origin);
    if (const uint64_t last = w.ledger.last(s); last != 0) {
      w.st.tracker->waited(origin, Position{s, last});
    }
    count(&Counters::events);
    count(&Counters::waits);
    count(&Counters::capture_joins);
  }
  return unjoined.size();
}

std::shared_ptr<CapturedGraph> capture_ended(const CaptureHandle* capture) {
  using namespace detail;
  if (capture == nullptr) {
    return nullptr;
  }
  const TrackedCapturePtr& w = capture->impl().tracked;
  if (w->ended.exchange(true)) {
    return nullptr;  // (ended already)
  }
  g_registry->remove(w->id);  // polls resume
  if (t_capture == w) {
    t_capture.reset();  // (on another thread, the beginning thread drops it at its next look)
  }
  GraphLedger::Graph g;
  std::vector<std::string> errors;
  {
    std::lock_guard<std::mutex> lock(w->st.mutex);
    g = w->ledger.finish();
    errors = std::move(w->errors);
  }  // (the capture's state goes with the last handle: its positions mean nothing any more)
  auto touched = std::make_shared<GraphReplay::Touched>();
  touched->kept.reserve(g.kept.size());
  touched->accesses.reserve(g.kept.size());
  for (GraphLedger::Kept& k : g.kept) {
    touched->kept.push_back(std::move(k.item));
    const c10::Device d = touched->kept.back().device();
    if (!d.is_cpu() &&
        std::find(touched->devices.begin(), touched->devices.end(), d) == touched->devices.end()) {
      touched->devices.push_back(d);
    }
  }
  for (size_t i = 0; i < g.kept.size(); ++i) {
    touched->accesses.push_back(Access{&touched->kept[i], g.kept[i].written});
  }
  touched->others = std::move(g.others);
  auto impl = std::make_unique<CapturedGraph::Impl>();
  impl->touched = std::move(touched);
  auto graph = std::make_shared<CapturedGraph>(std::move(impl));
  idle_if_unwanted();
  if (!errors.empty()) {
    std::string all;
    for (const std::string& e : errors) all += "\n  " + e;
    TORCH_CHECK(false, "torch_pipeline: tracking failed inside the graph capture on ", w->origin,
                ", so the graph is not safe to replay:", all);
  }
  return graph;
}

void set_capture_aware(bool aware) { detail::g_aware.store(aware); }

}  // namespace tracking
}  // namespace torch_pipeline
