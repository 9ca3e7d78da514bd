// The capture room (see capture.h and "Graph capture" in tracking.h): captures underway, each a
// world of its own; the hooks around a capture's begin and end; what a captured graph keeps and
// its replays. Touches the worlds it owns, the thread's capture, the query gate (capture.h of the
// runtime), and the main state only to end the capturing thread's run before a capture begins.
#include "capture.h"

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

#include <sstream>

namespace torch_pipeline {
namespace tracking {

struct CapturedGraph::Impl {
  std::mutex mutex;
  core::CapturedGraph<c10::Storage, c10::weak_intrusive_ptr<c10::StorageImpl>> graph;
};

namespace detail {
namespace {

std::atomic<bool> g_aware{true};

core::CaptureRegistry<CaptureWorld>& registry() {
  static auto* r = new core::CaptureRegistry<CaptureWorld>(query_gate());  // leaked, like state()
  return *r;
}

// The capture this thread began (or was first seen launching into, when begun without the hooks).
thread_local WorldPtr t_world;
// capture_prepare() ran and holds a pause of the gate until capture_begun / capture_abandoned.
thread_local bool t_prepared = false;

c10::Stream current_stream(const c10::Device& d) {
  return c10::impl::getDeviceGuardImpl(d.type())->getStream(d);
}

// A detected capture (begun without the hooks) whose origin no longer captures: it ended.
void end_detected(WorldPtr& w) {
  registry().remove(w->id);
  warn_once("capture without hooks",
            "a graph capture was begun without torch.cuda.graph / CUDAGraph.capture_begin (e.g. "
            "by an extension calling cudaStreamBeginCapture): its ops were captured with legal "
            "waits, but what the graph uses could not be tied to the graph object, so it was "
            "not kept alive past the capture and its replays are not ordered. Capture through "
            "torch.cuda.graph (or CUDAGraph.capture_begin / capture_end).");
  w.reset();
}

uintptr_t key_of(const c10::Storage& s) {
  return reinterpret_cast<uintptr_t>(s.unsafeGetStorageImpl());
}

// A tensor over the whole of `storage` (bytes), made without the dispatcher.
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

// "pipeline (worker thread 0, slot 1) on its stream <stream>", or the stream for one that no
// pipeline owns.
std::string describe(const c10::Stream& stream) {
  std::ostringstream out;
  for (const Runtime::SlotStream& s : Runtime::get().slot_streams()) {
    if (s.stream == stream) {
      out << "pipeline (worker thread " << s.worker_id << ", slot " << s.slot;
      if (s.priority != 0) out << ", priority " << s.priority;
      out << ") on its " << stream;
      return out.str();
    }
  }
  out << stream << " (no pipeline's)";
  return out.str();
}

}  // namespace

CaptureWorld::CaptureWorld(core::CaptureId i, const c10::Stream& o, bool n)
    : id(i), origin(o), notified(n), ledger(i, /*origin's id in st*/ 1) {
  st.period = kCapturePeriod | (i & ~kCapturePeriod);
  const StreamEntry& e = acquire_stream_locked(st, origin);  // (no baseline in a world)
  TORCH_INTERNAL_ASSERT(e.id == 1, "the origin of a capture is its world's first stream");
}

bool capture_aware() {
  return g_aware.load(std::memory_order_relaxed);
}

WorldPtr world_for_launch(const std::vector<c10::Device>& devices) {
  if (!capture_aware()) {
    return nullptr;
  }
  WorldPtr& mine = t_world;
  if (mine && !mine->notified && capture_of(mine->origin) != mine->id) {
    end_detected(mine);
  }
  for (const c10::Device& d : devices) {
    const c10::Stream stream = current_stream(d);
    const core::CaptureId id = capture_of(stream);
    switch (core::route_launch(mine ? mine->id : core::kNoCapture, id)) {
      case core::CaptureRoute::kEager:
        continue;
      case core::CaptureRoute::kFork:
        return mine;
      case core::CaptureRoute::kMixed:
        TORCH_CHECK(false, "torch_pipeline: an op was launched on ", stream,
                    ", which is capturing into another graph than the one this thread is "
                    "capturing (on ", mine->origin, "). Capture one graph per thread, and do "
                    "not use another thread's capturing stream.");
      case core::CaptureRoute::kCaptured:
        if (mine && (id == mine->id || id == core::kUnknownCapture)) {
          return mine;
        }
        if (id == core::kUnknownCapture) {
          continue;  // an invalidated capture never seen: left to the device
        }
        WorldPtr w = registry().find(id);
        if (!w) {
          w = registry().add(id, [&] {
            count(g_counters.captures);
            return std::make_shared<CaptureWorld>(id, stream, /*notified=*/false);
          });
          if (!mine) {
            mine = w;  // this thread detected it: it ends it when its origin stops capturing
          }
        }
        return w;
    }
  }
  return nullptr;
}

WorldPtr world_of_period(uint64_t period) {
  return registry().find(period & ~kCapturePeriod);
}

WorldPtr world_of_stream(const c10::Stream& stream) {
  if (!capture_aware()) {
    return nullptr;
  }
  const core::CaptureId id = capture_of(stream);
  if (id == core::kNoCapture) {
    return nullptr;
  }
  if (id == core::kUnknownCapture || (t_world && t_world->id == id)) {
    return t_world;
  }
  return registry().find(id);
}

void join_world_locked(CaptureWorld& w, StreamEntry& se) {
  if (w.ledger.joined(se.id)) {
    return;
  }
  if (capture_of(se.stream) != w.id) {
    // Not capturing into this capture: fork it in (it waits for the origin's captured work so
    // far; the event is recorded in the capture, so the wait is a captured edge).
    StreamEntry& o = *w.st.by_id.at(w.ledger.origin());
    c10::Event fork(o.stream.device_type());
    fork.record(o.stream);
    fork.block(se.stream);
    count(g_counters.events);
    count(g_counters.waits);
    count(g_counters.capture_forks);
    if (const uint64_t settled = o.log.settled(); settled != 0) {
      w.st.tracker->waited(se.id, Position{o.id, settled});
    }
  }
  w.ledger.join(se.id);
}

void capture_use_locked(CaptureWorld& w, StorageEntry& e, StreamEntry& se,
                        const c10::Storage& storage, bool write) {
  const uintptr_t key = key_of(storage);
  w.ledger.use(key, write, [&] { return storage.getWeakStorageImpl(); });
  // Made before the capture (home unknown here): every replay uses it. Made in the capture and
  // used on another stream: its block must not go to later captured work of its own stream.
  if (e.home == 0 || e.home != se.id) {
    if (w.ledger.keep(key, [&] { return storage; })) {
      count(g_counters.capture_kept);
    }
  }
}

void capture_output_locked(CaptureWorld& w, const c10::Storage& storage) {
  const uintptr_t key = key_of(storage);
  w.ledger.use(key, /*write=*/true, [&] { return storage.getWeakStorageImpl(); });
  if (storage.device().is_cpu() && w.ledger.keep(key, [&] { return storage; })) {
    count(g_counters.capture_kept);  // host memory a captured copy writes at every replay
  }
}

void reset_captures_after_fork() {
  registry().reset_after_fork();
  query_gate().reset_after_fork();
  if (t_world) {
    new WorldPtr(std::move(t_world));  // (leaked: its lock may be held by a thread now gone)
  }
  t_world.reset();
  t_prepared = false;
}

size_t captures_underway() {
  return registry().size();
}

}  // namespace detail

// ---- the hooks around a capture's begin and end -------------------------------------------------

void capture_prepare() {
  using namespace detail;
  if (!capture_aware()) {
    return;
  }
  TORCH_CHECK(!t_prepared && !(t_world && t_world->notified),
              "torch_pipeline: this thread is already capturing a graph; a thread captures one "
              "graph at a time (end that capture first)");
  query_gate().pause();
  t_prepared = true;
  if (!live()) {
    return;
  }
  // The thread's run of ops on its current stream ends here, outside the capture: its event is
  // recorded now (later waits for it find it kept) rather than inside the capture.
  LiveState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  ThreadRun& run = thread_run();
  if (run.last.seq != 0 && run.last_period == st.period) {
    record_locked(st, run.last.stream, run.last.seq);
  }
  run.last = Position{};
}

void capture_begun(const c10::Stream& stream) {
  using namespace detail;
  if (!t_prepared) {
    return;
  }
  t_prepared = false;
  const core::CaptureId id = capture_of(stream);
  if (id != core::kNoCapture && id != core::kUnknownCapture) {
    if (t_world && !t_world->notified) {
      end_detected(t_world);
    }
    t_world = registry().add(id, [&] {
      count(g_counters.captures);
      return std::make_shared<CaptureWorld>(id, stream, /*notified=*/true);
    });
  }
  query_gate().resume();  // (the registry holds its own pause while the capture is underway)
}

void capture_abandoned() {
  using namespace detail;
  if (t_prepared) {
    t_prepared = false;
    query_gate().resume();
  }
}

std::vector<std::string> capture_join_back() {
  using namespace detail;
  const WorldPtr w = t_world;
  if (!w) {
    return {};
  }
  std::vector<c10::Stream> streams;
  {
    std::lock_guard<std::mutex> lock(w->st.mutex);
    const StreamId origin = w->ledger.origin();
    const auto unjoined = w->ledger.unjoined(
        [&](StreamId a, const Position& p) { return w->st.tracker->is_ordered(a, p); });
    for (const StreamId s : unjoined) {
      StreamEntry& e = *w->st.by_id.at(s);
      // Joined now, so the device can end the capture (a captured edge).
      c10::Event join(e.stream.device_type());
      join.record(e.stream);
      join.block(w->origin);
      w->st.tracker->waited(origin, Position{s, w->ledger.last(s)});
      count(g_counters.events);
      count(g_counters.waits);
      count(g_counters.capture_joins);
      streams.push_back(e.stream);
    }
  }
  std::vector<std::string> names;
  for (const c10::Stream& s : streams) {
    names.push_back(describe(s));
  }
  return names;
}

std::shared_ptr<CapturedGraph> capture_ended() {
  using namespace detail;
  capture_abandoned();
  WorldPtr w = std::move(t_world);
  t_world.reset();
  if (!w) {
    return nullptr;
  }
  registry().remove(w->id);  // polls resume
  auto impl = std::make_unique<CapturedGraph::Impl>();
  {
    std::lock_guard<std::mutex> lock(w->st.mutex);
    impl->graph = decltype(impl->graph)(w->ledger.finish());
  }
  w.reset();  // (the world's events and entries go; its positions mean nothing any more)
  if (live() && g_pipelines.load() == 0 && g_pins.load() == 0) {
    update_live(/*settle=*/false);  // a capture underway kept tracking live
  }
  return std::make_shared<CapturedGraph>(std::move(impl));
}

void set_capture_aware(bool aware) {
  detail::g_aware.store(aware);
}

// ---- a captured graph and its replays -------------------------------------------------------------

CapturedGraph::CapturedGraph(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CapturedGraph::~CapturedGraph() = default;

size_t CapturedGraph::kept() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->graph.kept();
}

void CapturedGraph::reset() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->graph.reset();
}

GraphReplay::GraphReplay(const CapturedGraph& graph) {
  using namespace detail;
  if (!live()) {
    return;
  }
  std::vector<bool> written;
  {
    auto& g = const_cast<CapturedGraph::Impl&>(graph.impl());
    std::lock_guard<std::mutex> lock(g.mutex);
    g.graph.for_each_alive([&](const c10::weak_intrusive_ptr<c10::StorageImpl>& ref, bool,
                               bool w) {
      c10::intrusive_ptr<c10::StorageImpl> impl = ref.lock();
      if (impl && impl->data() != nullptr) {
        tensors_.push_back(tensor_of(c10::Storage(std::move(impl))));
        written.push_back(w);
      }
    });
  }
  if (tensors_.empty()) {
    return;
  }
  count(g_counters.graph_replays);
  std::vector<Access> accesses;
  accesses.reserve(tensors_.size());
  for (size_t i = 0; i < tensors_.size(); ++i) {
    accesses.push_back(Access{&tensors_[i], written[i]});
    if (!tensors_[i].device().is_cpu() && in_pipeline()) {
      enter_device(tensors_[i].device());
    }
  }
  open_scope(accesses, launched_, period_, keep_alive_);
}

GraphReplay::~GraphReplay() {
  close();
}

void GraphReplay::close() {
  if (!launched_.empty()) {
    detail::close_scope(launched_, period_, keep_alive_, nullptr, "a graph replay");
  }
  tensors_.clear();
}

}  // namespace tracking
}  // namespace torch_pipeline
