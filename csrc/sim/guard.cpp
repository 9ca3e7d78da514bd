// Events and the DeviceGuardImpl of the sim device: c10's interface to its devices, streams and
// events. An event is a snapshot of a stream's vector clock (race_checker.h) and, in asynchronous
// mode, a marker queued on the stream (executor.h): it is complete once the stream ran it.
#include "allocator.h"
#include "executor.h"
#include "fork.h"
#include "graph_capture.h"
#include "state.h"
#include "trace.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>

namespace torch_pipeline {
namespace sim {
namespace {

// Guards the state of every event. record() may run on one thread while block/synchronize/query
// read the event on another (torch allows that, as CUDA does). One lock for all events (held for a
// copy of a clock), so that fork() can take it (fork.h).
std::mutex g_events_mutex;

// An event's state (guarded by g_events_mutex).
struct SimEvent {
  struct Recorded {
    VectorClock clock;
    bool recorded = false;
    c10::DeviceIndex device = -1;
    Timeline timeline = -1;
    uint64_t position = 0;  // the marker's position in the stream's queue (0: synchronous)
    core::CaptureId capture = core::kNoCapture;  // recorded in this capture (graph_capture.h)
    // When the marker ran (steady clock, ns): the device time of the event.
    std::shared_ptr<std::atomic<int64_t>> time_ns;
  };

  explicit SimEvent(bool timing) : timing(timing) {}

  Recorded get() const {
    std::lock_guard<std::mutex> lock(g_events_mutex);
    return state;
  }

  void set(Recorded r) {
    std::lock_guard<std::mutex> lock(g_events_mutex);
    state = std::move(r);
  }

  const bool timing;

 private:
  Recorded state;
};

struct SimGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kSim; }

  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old = getDevice();
    setDevice(d);
    return old;
  }

  c10::Device getDevice() const override { return c10::Device(kSim, current_device()); }

  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kSim, "sim device guard got a device of type ", d.type());
    set_current_device(check_device(d.index()));
  }

  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < State::get().num_devices()) {
      set_current_device(d.index());
    }
  }

  c10::Stream getStream(c10::Device d) const override {
    return current_stream(check_device(d.index()));
  }

  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kSim, check_device(d.index())));
  }

  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority) const override {
    return State::get().pool_stream(d.index(), high_priority);
  }

  c10::Stream getNewStream(c10::Device d, int priority) const override {
    // Like CUDA's: a stream of the pool of that priority (exclusive streams for pipelines come
    // from the factory that enable() registers).
    return State::get().pool_stream(d.index(), priority);
  }

  c10::Stream exchangeStream(c10::Stream s) const override { return exchange_stream(s); }

  void* getStreamNativeHandle(const c10::Stream s) const override {
    // No native object: the timeline id serves as an opaque, unique handle.
    return reinterpret_cast<void*>(static_cast<uintptr_t>(State::get().timeline(s)));
  }

  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<SimEvent*>(event);
  }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(),
                "event of device sim:", static_cast<int>(device_index),
                " cannot be recorded on a stream of ", stream.device());
    const Timeline t = State::get().timeline(stream);
    auto* e = static_cast<SimEvent*>(*event);
    if (e == nullptr) {
      e = new SimEvent(flag == c10::EventFlag::BACKEND_DEFAULT);
      *event = e;
    }
    SimEvent::Recorded r;
    r.time_ns = std::make_shared<std::atomic<int64_t>>(0);
    r.position = launch_marker(t, [time = r.time_ns] {
      time->store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
    });
    if (!captured_snapshot(t, r.capture, r.clock)) {
      r.clock = State::get().checker().snapshot(t);
    }
    r.recorded = true;
    r.device = stream.device_index();
    r.timeline = t;
    e->set(std::move(r));
  }

  void block(void* event, const c10::Stream& stream) const override {
    const Timeline t = State::get().timeline(stream);
    auto* e = static_cast<SimEvent*>(event);
    const SimEvent::Recorded r = e != nullptr ? e->get() : SimEvent::Recorded{};
    if (!r.recorded) {
      return;  // never recorded: nothing to wait for
    }
    // (else a capture's edge, joined there)
    if (!captured_wait(t, stream.id() == c10::Stream::DEFAULT, r.capture, r.clock)) {
      State::get().checker().join(t, r.clock);
    }
    stream_wait(t, r.timeline, r.position);
    if (trace::on()) {  // an arrow from the event's stream to the waiter, once the wait is over
      const Timeline from = r.timeline;
      launch_marker(t, [t, from, time = r.time_ns] {
        const int64_t now = trace::now_ns();
        const int64_t recorded = time->load();
        trace::wait(t, from, recorded != 0 ? recorded : now, now);
      });
    }
  }

  bool queryEvent(void* event) const override {
    check_not_capturing("an event query");
    auto* e = static_cast<SimEvent*>(event);
    const SimEvent::Recorded r = e != nullptr ? e->get() : SimEvent::Recorded{};
    if (!r.recorded) {
      return true;
    }
    if (!stream_reached(r.timeline, r.position)) {
      return false;  // asynchronous mode: the stream has not run the marker yet
    }
    host_join(r.clock);
    return true;
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(State::get().num_devices());
  }

  c10::DeviceCapability getDeviceCapability(c10::Device) const override {
    // torch.accelerator.get_device_capability: the dtypes a sim tensor can be made of and
    // converted from and to, those of the CPU's copy kernel (the sim runs it): every dtype of
    // this torch (a newer torch's new ones too, e.g. 2.14's bcomplex32) less the quantized ones
    // (PyTorch has no quantized PrivateUse1 kernels), the bit containers and the sub-byte and
    // packed fp4 dtypes (no conversion to or from float32).
    c10::DeviceCapability cap;
    cap.capability_data.capability_bits = 0;
#define TP_SIM_CONVERTS(_, name)                                              \
  if (sim_converts(c10::ScalarType::name)) {                                  \
    cap.capability_data.capability_bits |= uint64_t{1} << c10::kIndex_##name; \
  }
    AT_FORALL_SCALAR_TYPES_WITH_COMPLEX_AND_QINTS(TP_SIM_CONVERTS)
#undef TP_SIM_CONVERTS
    return cap;
  }

  static bool sim_converts(c10::ScalarType t) {
    const auto i = static_cast<int>(t);
    const bool sub_byte = i >= static_cast<int>(c10::ScalarType::UInt1) &&
                          i <= static_cast<int>(c10::ScalarType::Int7);
    return !c10::isQIntType(t) && !c10::isBitsType(t) && !sub_byte &&
           t != c10::ScalarType::Float4_e2m1fn_x2;
  }

  bool queryStream(const c10::Stream& stream) const override {
    check_not_capturing("a stream query");
    const Timeline t = State::get().timeline(stream);
    if (!stream_reached(t, stream_position(t))) {
      return false;
    }
    host_sync(t);
    return true;
  }

  void synchronizeStream(const c10::Stream& stream) const override {
    host_sync(State::get().timeline(stream));
  }

  void synchronizeEvent(void* event) const override {
    check_not_capturing("an event synchronize");
    auto* e = static_cast<SimEvent*>(event);
    const SimEvent::Recorded r = e != nullptr ? e->get() : SimEvent::Recorded{};
    if (r.recorded) {
      host_wait(r.timeline, r.position);
      host_join(r.clock);
    }
  }

  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    synchronize(check_device(device_index));
  }

  void recordDataPtrOnStream(const c10::DataPtr& data_ptr,
                             const c10::Stream& stream) const override {
    record_stream(data_ptr, stream);
  }

  double elapsedTime(void* event1, void* event2, const c10::DeviceIndex) const override {
    check_not_capturing("elapsed_time");
    auto* a = static_cast<SimEvent*>(event1);
    auto* b = static_cast<SimEvent*>(event2);
    const SimEvent::Recorded ra = a != nullptr ? a->get() : SimEvent::Recorded{};
    const SimEvent::Recorded rb = b != nullptr ? b->get() : SimEvent::Recorded{};
    TORCH_CHECK(ra.recorded && rb.recorded, "elapsed_time: both events must have been recorded");
    TORCH_CHECK(a->timing && b->timing,
                "elapsed_time: both events must be created with argument 'enable_timing=True'");
    // As on CUDA, which cannot time events of two devices against each other.
    TORCH_CHECK(ra.device == rb.device,
                "elapsed_time: the events were recorded on sim:", static_cast<int>(ra.device),
                " and sim:", static_cast<int>(rb.device),
                "; both must be recorded on the same device");
    host_wait(ra.timeline, ra.position);  // device times: when the markers ran
    host_wait(rb.timeline, rb.position);
    return static_cast<double>(rb.time_ns->load() - ra.time_ns->load()) / 1e6;
  }
};

}  // namespace

const c10::impl::DeviceGuardImplInterface* make_guard_impl() { return new SimGuardImpl(); }

void lock_events_for_fork() { g_events_mutex.lock(); }

void unlock_events_after_fork() { g_events_mutex.unlock(); }

}  // namespace sim
}  // namespace torch_pipeline
