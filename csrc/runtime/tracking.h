// Automatic synchronization (docs/design.md, "Automatic synchronization"): the core
// DependencyTracker bound to c10. The one public header of the tracker; its modules live in
// csrc/runtime/tracking/ (see state.h there).
//
// While tracking is live, the observer sees the outermost op of every observed thread (autograd
// engine threads included) before it launches, with its inputs, the arguments its schema marks
// written, and, after it, its fresh outputs: a dispatcher fallback on a thread-local key, or a
// global RecordFunction callback (see Observer). Tensors map to storages; storages on an
// accelerator are accessed on the current stream of their device. Before the op, the current
// stream waits (c10 event waits) for what the tracker says: the last writer of what it reads, and
// the last writer and the readers since of what it writes, on other streams, each producer stream
// at most once and only when not already implied. Events are recorded where a thread's run of ops
// on one stream ends (and on demand), so a wait costs one event, and a run of ops costs none.
// A storage used on a stream other than its allocation stream is kept from reuse until that use
// completes (see AllocatorSafety). CPU tensors that a non_blocking copy reads or writes on a
// stream are watched: a CPU op that touches them first synchronizes with
// that copy. A tensor passed to submit is pinned by the task: a write to it from another thread
// waits until the task has finished.
//
// Tracking is live while a non-default pipeline (or a task pinning tensors) is alive; otherwise
// nothing observes and ops pay nothing. Going live orders the streams that were current
// before (recorded as a baseline each newly seen stream waits for once); going idle makes every
// stream that was tracked wait for every other one of its device, and synchronizes with pending
// copies into watched CPU memory, so work before and after a live period stays ordered.
#pragma once

#include "../core/dependency_tracker.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace tracking {

// Called by the runtime as non-default pipelines are created and destroyed. pipeline_created()
// returns once tracking is live (waiting, through the blocking wait below, for another thread
// that is going idle); pipeline_destroyed() never waits: the thread switching sees the request.
void pipeline_created();
void pipeline_destroyed();

// Whether ops are observed now.
bool live();

// How ops are observed (docs/design.md, "What observing costs"). kDispatcher (the default): a
// boxed dispatcher fallback on a thread-local mode key, paid once per observed op, by the threads
// that carry the key: those that create or enter a pipeline, submit a task or call
// observe_this_thread(), the worker threads, the autograd engine's threads (the key travels in
// at::ThreadLocalState), and Python threads (the Python layer sweeps them when tracking goes
// live). Device ops of other threads are noticed (backends call device_op_seen; a sampled
// RecordFunction check elsewhere), warned about once, and those threads observed from then on.
// kRecordFunction: a global RecordFunction callback, paid on every operator call (callees
// included) of every thread. TORCH_PIPELINE_OBSERVER=dispatcher|record_function sets it (read at
// the first go-live); set_observer (tests) changes it while idle.
enum class Observer { kDispatcher, kRecordFunction };
void set_observer(Observer observer);
Observer observer();
// The calling thread carries the dispatcher path's key while tracking is live (no-op otherwise).
void observe_this_thread();
// Whether the calling thread carries the dispatcher path's key: included, excluded (inside an
// observed op, or hidden). For tests.
std::pair<bool, bool> observer_key_state();
// Whether the dispatcher path's check of Dynamo's ranges is installed. For tests.
bool range_check_installed();
// Test switches: the calling thread drops the key (as a thread the runtime never knew); the
// sampled check's share of events (from the next go-live) and whether backends check (off: the
// sampled check is wanted for every device type, as for one whose backend does not check).
void forget_this_thread();
void set_unobserved_checks(double sampling, bool backend);
// Test switch: the calling thread's ops are hidden from the dispatcher path (its key excluded),
// as kernels launched outside the dispatcher are.
void set_thread_hidden(bool hidden);
// Bumped each time tracking goes live on the dispatcher path (0 while it does not observe): the
// Python layer sweeps its threads when it changes.
uint64_t observed_generation();
// A backend is about to run device op `op` on the calling thread: warns (once) if the dispatcher
// path does not observe this thread, and observes it from then on. Cheap otherwise.
void device_op_seen(const char* op);
// The backend of `type` calls device_op_seen before every device op it runs (the sim device does):
// the dispatcher path then needs no sampled RecordFunction check for that type (Note [The
// sampled check is installed on demand]).
void set_backend_checks(c10::DeviceType type);
// Whether the dispatcher path's sampled check of other threads is installed. For tests.
bool sampled_check_installed();

// Test switch: with enabled == false tracking never goes live (and stops if it is), so tests can
// show the races it removes. On by default.
void set_enabled(bool enabled);
bool enabled();

// Allocator safety (docs/design.md, "The rules"): a storage used on a stream other than its
// allocation stream is kept from reuse until that use completes, either by keeping a reference
// until an event after the use has completed (kKeepAlive, the default; polled every few device
// launches and after synchronize: the memory returns once the use is done, however deep the using
// stream's queue is, as ProcessGroupNCCL's tensor stashing does) or by the caching allocator's
// record_stream (kRecordStream: when the storage is freed the allocator records an event on the
// using stream and reuses the block once all the work queued there then has completed).
// bench/bench_allocator.py compares them; README.md says why keeping alive is the default. Storages
// whose allocation stream is unknown (made before tracking went live, or outside any op) always use
// record_stream. TORCH_PIPELINE_ALLOCATOR_SAFETY=keep_alive|record_stream sets the initial mode
// (read on first use; "hold" is accepted as an old name of keep_alive).
enum class AllocatorSafety { kKeepAlive, kRecordStream };
void set_allocator_safety(AllocatorSafety safety);
AllocatorSafety allocator_safety();

// Asynchronous collectives (c10d ops that return a Work, async_op=True): their kernels may run on
// a stream of the process group's own, which the op does not show. The tracker remembers the
// device tensors each one writes, by its Work; when work.wait() has made the current streams wait
// for it (the Python layer hooks Work.wait), work_waited() records those tensors as written there,
// so later readers on any stream wait for the right point. Unknown works are ignored.
void work_waited(const void* work);

// Lets go of storages kept alive whose uses are complete (also done every few device launches). The
// Python layer calls it after the host synchronized.
void poll();

struct Stats {
  bool live = false;
  uint64_t ops = 0;             // outermost ops observed
  uint64_t launches = 0;        // tracker launches (one per device stream an op used)
  uint64_t waits = 0;           // event waits inserted on streams
  uint64_t events = 0;          // events recorded at positions
  uint64_t host_waits = 0;      // host synchronizations before CPU ops on watched memory
  uint64_t record_streams = 0;  // allocator record_stream calls
  uint64_t pin_waits = 0;       // writes that waited for a task that pins their tensor
  uint64_t keep_alives = 0;     // storages kept alive for allocator safety (uses off their stream)
  uint64_t released = 0;        // of those, let go after their use completed
  uint64_t kept_alive = 0;      // kept alive now
  uint64_t kept_alive_bytes = 0;  // their bytes
  uint64_t storages = 0;          // storages with tracked state now
  uint64_t streams = 0;           // streams known in the current live period
  uint64_t unclaimed = 0;         // ops on tensors without storage (torch.func, wrapper subclasses)
                                  // left to the ops they call
  uint64_t gaps = 0;              // ops seen on a device whose accesses could not be accounted for
  std::vector<std::string> gap_ops;  // their operator names (each warned about once)
  uint64_t compiled_regions = 0;     // compiled-region calls tracked as one op (CompiledRegion)
  uint64_t compiled_unwrapped = 0;   // compiled regions that ran without one (warned about once)
  uint64_t captures = 0;             // graph captures begun through the hooks
  uint64_t captures_underway = 0;    // of those, underway now (device queries paused meanwhile)
  int64_t queries_paused = 0;  // pauses of the tracker's device queries now (captures underway
                               // or about to begin)
  uint64_t capture_forks = 0;  // streams forked into a capture (a side pipeline's first op in it)
  uint64_t capture_joins = 0;  // streams joined back at a capture's end (their work unwaited for)
  uint64_t capture_kept = 0;   // storages kept alive for the lifetime of captured graphs
  uint64_t graph_replays = 0;  // replays of captured graphs ordered like one op
  uint64_t polls_paused =
      0;                    // keep-alive polls and host waits skipped while a capture was underway
  uint64_t unobserved = 0;  // device ops of threads the dispatcher path did not observe (warned)
  std::string observer;     // "dispatcher" or "record_function" (see Observer)
};
Stats stats();

// What each part of the tracker's state holds now (docs/design.md, "The tracker's parts"), read
// under its lock: for the tests of each part (tests/python/tracking/) and bug reports.
struct PartsSnapshot {
  uint64_t period = 0;
  // tracker (core::DependencyTracker)
  uint64_t tracker_storages = 0, tracker_records = 0, tracker_history = 0;
  // streams (StreamTable): entries, positions still launching, events kept by position
  uint64_t stream_entries = 0, streams_in_flight = 0, stream_events = 0;
  // storages (StorageTable): entries (some dead until a sweep), young outputs, sweeps
  uint64_t storage_entries = 0, young = 0, sweeps = 0;
  // kept (KeptStorages): its count, the storages in its queues counted one by one, the streams
  // with any
  uint64_t kept = 0, kept_queued = 0, kept_streams = 0;
  // async_works (AsyncWorks)
  uint64_t async_works = 0;
};
PartsSnapshot parts_snapshot();

// How the tracker blocks the calling thread (for a task that pins a tensor being written, or
// for another thread going idle):
// `wait(step)` until step(timeout) returns true. The Python layer installs one that lets go of
// the GIL while waiting (the task needs it). Default: plain polling.
using Step = std::function<bool(std::chrono::milliseconds)>;
using BlockingWait = std::function<void(const Step&)>;
void set_blocking_wait(BlockingWait wait);

// External waits (docs/design.md, "Deduplication": "a stream never waits twice for the same
// producer position"): where the runtime itself makes a stream wait for an event
// (PipelineEvent.wait, a task's streams waiting for the submitter, future.wait()), it takes a mark
// of the recorded stream just before recording the event and reports the wait with it, so the
// tracker inserts no wait the event already implies. Marks of another live period (or taken while
// idle) are ignored.
struct Mark {
  uint64_t period = 0;  // the live period the mark was taken in (0: none)
  core::StreamId stream = 0;
  uint64_t seq = 0;  // every op of `stream` up to this position launched before the mark
};
Mark mark(const c10::Stream& stream);
void waited(const c10::Stream& waiter, const Mark& mark);

// An op's (or a tp.track scope's) launch on one stream: the position it got there.
struct Launched {
  c10::Stream stream;
  core::StreamId id;
  uint64_t seq;
  c10::Device device() const { return stream.device(); }
};
// A storage used off its allocation stream (allocator safety), kept alive from the end of the use.
struct PendingKeepAlive {
  core::StreamId id;
  c10::Stream stream;
  c10::Storage storage;
};

// tp.track(read=..., write=...): accesses of kernels the dispatcher never sees (raw launches on
// data pointers) on the current streams of the tensors' devices. The constructor makes those
// streams wait as for an op; the destructor records the end of the accesses. No-op while idle.
class TrackScope {
 public:
  TrackScope(const std::vector<at::Tensor>& reads, const std::vector<at::Tensor>& writes);
  ~TrackScope();
  TrackScope(const TrackScope&) = delete;
  TrackScope& operator=(const TrackScope&) = delete;

 private:
  uint64_t period_ = 0;  // the live period of the launch
  std::vector<Launched> launched_;
  std::vector<PendingKeepAlive> keep_alive_;  // kept alive from the end of the scope, like an op's
};

// UntypedStorage.resize_ on a device storage (FSDP frees and reallocates parameters' memory with
// it: storage.resize_(0), resize_(n)) is not a dispatcher op; torch_pipeline/_storages.py wraps it
// in this scope. Made before the resize: the current stream waits as for an op that writes the
// storage and may give it new memory (its old block, freed inside the resize, is recorded on the
// current stream off its allocation stream: OpFacts::may_move). done() after it: memory it
// allocated (the storage had none, or other memory now) was allocated on the current stream, the
// storage's home from then on. No-op while idle, and for CPU storages.
class StorageResize {
 public:
  explicit StorageResize(const c10::Storage& storage);
  void done();
  ~StorageResize();  // done() if not called
  StorageResize(const StorageResize&) = delete;
  StorageResize& operator=(const StorageResize&) = delete;

 private:
  at::Tensor view_;               // bytes of the storage (the tracker's accesses are tensors)
  const void* before_ = nullptr;  // its memory before the resize
  bool open_ = false;
  uint64_t period_ = 0;
  std::vector<Launched> launched_;
  std::vector<PendingKeepAlive> keep_alive_;
};

// A call of a compiled region (torch.compile: AOTAutograd's forward, backward or inference call,
// wrapped by torch_pipeline/_compiled.py) as one op on the current streams: the constructor reads
// and writes every tensor argument (lifted parameters and buffers, inputs, saved tensors: compiled
// kernels may write any of them) and enters their devices into the current pipeline; the ops it
// calls are not observed while it runs on this thread (its kernels are its own, whether the
// dispatcher sees them or not), but for inductor::resize_storage_bytes_ (a block freed or allocated
// mid-region); outputs() names what it made; close() ends it, like an op's end. No-op while idle,
// or inside an observed op or region. Whether compiled regions are wrapped (see regions_wrapped in
// tracking/observer.h), and that torch._dynamo is imported (before, no compiled region can run, and
// the check of unwrapped regions is not installed).
void set_regions_wrapped(bool wrapped);
void set_dynamo_loaded();

class CompiledRegion {
 public:
  explicit CompiledRegion(const std::vector<at::Tensor>& args);
  ~CompiledRegion();  // close()
  // Ends the region (idempotent): Python calls it in a finally, as a traceback may keep the
  // object alive.
  void close();
  CompiledRegion(const CompiledRegion&) = delete;
  CompiledRegion& operator=(const CompiledRegion&) = delete;
  void outputs(const std::vector<at::Tensor>& outs);

 private:
  bool open_ = false;
  uint64_t period_ = 0;
  std::vector<at::Tensor> args_;
  std::vector<Launched> launched_;
  std::vector<PendingKeepAlive> keep_alive_;
  std::vector<at::Tensor> fresh_;
};

// ---- Graph capture (docs/design.md, "Graph capture") ------------------------------------------
// The Python layer calls these around a capture's begin and end (torch.cuda.CUDAGraph's and
// torch.accelerator.Graph's capture_begin / capture_end, and sim.Graph's). While a capture is
// underway no event or stream is queried or synchronized by the tracker (polls pause, in every
// thread); the ops launched on the capture's streams are captured: the waits inserted between
// them are captured event record + wait edges, a stream outside the capture (a side pipeline's)
// is forked into it before the capturing thread's first op there, and nothing waits for work
// outside the capture (each replay is ordered instead). They do nothing while the test switch
// set_capture_aware(false) is set.
//
// capture_prepare(stream), on the capturing thread before the device begins capturing on
// `stream` (its current stream): polls pause (the queries running now finish first), and the
// thread's run of ops and the eager work on `stream` so far get their events, outside the
// capture. capture_begun(stream) after the begin, on the same thread, registers the capture
// `stream` now captures into and returns its handle (nullptr if it is not capturing: nothing to
// track); the pause of capture_prepare ends either way (a registered capture holds its own).
// capture_abandoned() undoes capture_prepare() when the begin failed. Errors leave no pause
// behind.
class CaptureHandle {
 public:
  struct Impl;
  explicit CaptureHandle(std::unique_ptr<Impl> impl);
  ~CaptureHandle();
  CaptureHandle(const CaptureHandle&) = delete;
  CaptureHandle& operator=(const CaptureHandle&) = delete;
  const Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};
void capture_prepare(const c10::Stream& stream);
std::shared_ptr<CaptureHandle> capture_begun(const c10::Stream& stream);
void capture_abandoned();

// What a captured graph keeps (the Python layer attaches it to the graph object): the storages
// it uses that existed before the capture or were used in it off the stream they were born on,
// alive for the graph's lifetime (until it is dropped or reset), and weak references to the
// others it touches, so that each replay is ordered like one op on the replaying stream
// (GraphReplay).
class CapturedGraph {
 public:
  struct Impl;
  explicit CapturedGraph(std::unique_ptr<Impl> impl);
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  size_t kept() const;  // storages kept alive
  void reset();         // the graph was reset: nothing is kept
  const Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// Before the end of `capture` (on any thread): joins back the streams (side pipelines') that
// ending it now would leave unjoined: their captured work the capturing stream was not made to
// wait for, or a fork with no work after it. The origin waits for each (a captured edge), so
// that the device can end the capture (CUDA would fail it with cudaErrorStreamCaptureUnjoined)
// and each replay covers the side work too. Returns how many it joined; 0 for nullptr.
size_t capture_join_back(const CaptureHandle* capture);
// After the end (whether it succeeded or not; on any thread): the capture is over and polls
// resume. Returns what the graph keeps (nullptr for nullptr, or a capture ended already).
// TORCH_CHECK error, after all of that, when tracking failed inside the capture (an op on another
// capture's stream, or on a default stream that cannot join it): the graph is not safe to replay.
std::shared_ptr<CapturedGraph> capture_ended(const CaptureHandle* capture);

// A replay of a captured graph (CUDAGraph.replay), from construction to close(): one op on the
// current streams of the graph's devices that reads what the graph read and writes what it wrote
// (the storages still alive), so the replay waits for their producers on other streams and
// later users wait for it. The accesses of the storages the graph keeps are built once, when the
// capture ends. No-op while idle.
class GraphReplay {
 public:
  struct Touched;  // what one replay touches (shared with the graph)
  explicit GraphReplay(const CapturedGraph& graph);
  ~GraphReplay();  // close()
  void close();
  GraphReplay(const GraphReplay&) = delete;
  GraphReplay& operator=(const GraphReplay&) = delete;

 private:
  uint64_t period_ = 0;
  std::shared_ptr<const Touched> touched_;  // (holds the kept tensors while the replay is open)
  std::vector<at::Tensor> others_;          // the graph's other storages, alive at this replay
  std::vector<Launched> launched_;
  std::vector<PendingKeepAlive> keep_alive_;
};

// Test switch: with aware == false the tracker ignores captures (the behaviour before it knew of
// them: polls do not pause, captured ops are tracked as run), so tests show what goes wrong.
void set_capture_aware(bool aware);

// The tensors of a submitted task (docs/design.md, "The Python API and the rules users rely on"):
// until release(), a write to their storages from a thread other than the task's worker thread
// waits for release(), unless it is the task's own work (see Running). Keeps tracking live.
class TaskPins {
 public:
  // Made where the task is submitted: a task submitted by a running task inherits its Running set.
  TaskPins(const std::vector<at::Tensor>& tensors, int worker_id);
  ~TaskPins();
  TaskPins(const TaskPins&) = delete;
  TaskPins& operator=(const TaskPins&) = delete;
  // The task no longer needs its tensors (it finished, or it was cancelled). Idempotent.
  void release();

  struct State;

  // While a task runs, on its worker thread: writes of this thread do not wait for the task's own
  // pins nor for those of the tasks that submitted it, at any depth (its inherited set). A task
  // that hands its tensors to a task it submits and waits for it would otherwise wait forever: the
  // inner task's write waited for the outer task's end.
  class Running {
   public:
    explicit Running(const TaskPins& pins);
    ~Running();
    Running(const Running&) = delete;
    Running& operator=(const Running&) = delete;

   private:
    std::vector<std::shared_ptr<State>> saved_;
  };

 private:
  std::shared_ptr<State> state_;
  std::vector<std::shared_ptr<State>> inherited_;  // the submitting task's Running set
};

}  // namespace tracking
}  // namespace torch_pipeline
