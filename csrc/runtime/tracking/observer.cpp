// The observer module (see observer.h): what an observed op means (op_start / op_end, whichever
// path saw it) and its per-thread state only. Reads op facts (op_facts.h) and the lock-free
// switches; acts through the pins, host-watch, launch and collectives modules.
#include "observer.h"

#include "../context.h"
#include "../ivalue_tensors.h"
#include "../op_facts.h"
#include "../thread_local_ref.h"
#include "../warn.h"
#include "borrowed_tensors.h"
#include "collectives.h"
#include "graph_capture.h"
#include "host_watch.h"
#include "keep_alive.h"
#include "launch.h"
#include "life.h"
#include "pins.h"
#include "state.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

namespace torch_pipeline {
namespace tracking {
namespace detail {

namespace {

// Tls::active of a thread inside a compiled region (no level is negative).
constexpr int kInRegion = -1;
// The one op observed inside a compiled region (see on_start).
constexpr const char kResizeStorageBytes[] = "inductor::resize_storage_bytes_";

// Per-thread state of the op being observed (only the outermost one of a thread).
struct Tls {
  int level = 0;   // op_start nesting on this thread
  int active = 0;  // level of the observed (outermost) op, 0 if none
  // The observed op is a storage resize inside a compiled region (kInRegion again at its end).
  bool in_region = false;
  uint64_t period = 0;     // the live period of its launch
  bool async = false;      // a non_blocking copy: its CPU storages are accessed on the stream
  bool host_only = false;  // the op has nothing on a device and nothing watched: no end work
  bool c10d = false;       // a c10d op (a collective): it may return a Work
  // The device tensors a c10d op writes, owned: its boxed inputs, which `accesses` point into, are
  // destroyed once the start callbacks have run, and a Work it returns is noted at its end.
  std::vector<at::Tensor> c10d_written;
  const OpFacts* facts = nullptr;  // the observed op's
  std::vector<Launched> launched;
  std::vector<const c10::StorageImpl*> inputs;
  std::vector<Access> accesses;
  std::vector<at::Tensor> list_items;  // owned copies of tensors inside list arguments ...
  std::vector<bool> list_writes;       // ... and their write flags
  std::vector<Access> scratch;
  BorrowedTensors fresh;  // borrowed from op_end's outputs and from `moving` (cleared first)
  // Device tensors the op may give new memory (OpFacts::may_move) and their data before it (owned:
  // the boxed inputs do not outlive the start callback); those it did reallocate (resize_), whose
  // storage has a new home.
  std::vector<std::pair<at::Tensor, const void*>> moving;
  std::vector<at::Tensor> moved;
  // Storages of written arguments without data (out= tensors of size 0): the op allocates them.
  std::vector<const c10::StorageImpl*> empty_writes;
  // Ops left to the ops they call (tensors without storage, see on_start), innermost last: their
  // level, their facts, whether they touch an accelerator, and `observed` when they started.
  struct Unclaimed {
    int level;
    const OpFacts* facts;
    bool on_device;
    uint64_t observed;
  };
  std::vector<Unclaimed> unclaimed;
  uint64_t observed = 0;     // ops this thread looked at (not transparent), nested ones included
  uint64_t regions = 0;      // compiled regions this thread opened (CompiledRegion)
  ThreadRun* run = nullptr;  // thread_run(), looked up once
  ThreadRun& thread_run() {
    if (C10_UNLIKELY(run == nullptr)) {
      run = &detail::thread_run();
    }
    return *run;
  }
};
thread_local Tls tls;

// A tensor the tracker cannot follow to memory: defined, with elements, but without storage data
// and not on meta memory: a torch.func BatchedTensor or GradTrackingTensor, a __torch_dispatch__
// wrapper subclass (the pattern DTensor is built on), a sparse tensor. The op it stands for runs
// its real work in the ops it calls, on real tensors.
bool opaque(const at::Tensor& x) {
  if (has_data(x) || x.is_meta()) {
    return false;
  }
  if (x.has_storage() && x.storage().device().is_meta()) {
    return false;  // a fake tensor (tracing): no memory at all
  }
  // A dense tensor whose storage was freed (FSDP's resize_(0)) stands for no other tensor: an op
  // on it (resize_storage_bytes_ growing it again) is its own.
  static const c10::DispatchKeySet kStandIns{
      c10::DispatchKey::Python, c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Functionalize};
  if (x.has_storage() && x.layout() == c10::kStrided && x.storage().nbytes() == 0 &&
      (x.key_set() & kStandIns).empty()) {
    return false;
  }
  const auto n = x.unsafeGetTensorImpl()->sym_numel().maybe_as_int();
  return !n.has_value() || *n > 0;
}

// One pass over an op's inputs: its opaque tensors (0: none; 1: only on the CPU; 2: one on an
// accelerator) and whether anything puts it on a device (a device tensor, also in a list, or a
// device argument of factories and to()).
struct InputScan {
  int opaque = 0;
  bool on_device = false;
};
InputScan scan_inputs(const c10::ArrayRef<c10::IValue>& inputs) {
  InputScan scan;
  for (const c10::IValue& v : inputs) {
    if (v.isDevice()) {
      scan.on_device |= !v.toDevice().is_cpu();
      continue;
    }
    for_each_tensor(v, [&](const at::Tensor& x) {
      const bool cpu = x.device().is_cpu();
      scan.on_device |= !cpu;
      if (opaque(x)) {
        scan.opaque = std::max(scan.opaque, cpu ? 1 : 2);
      }
      return scan.opaque == 2;
    });
    if (scan.opaque == 2) {
      break;
    }
  }
  return scan;
}

void add_tensor(const at::Tensor& t, bool write, bool may_move, Tls& tls_of_op) {
  if (has_data(t)) {
    tls_of_op.accesses.push_back(Access{&t, write, write && may_move});
  } else if (write && t.defined() && t.has_storage()) {
    // (an out= tensor of size 0, a storage resize_storage_bytes_ grows from none)
    tls_of_op.empty_writes.push_back(t.storage().unsafeGetStorageImpl());
    if (may_move && !t.device().is_cpu()) {
      tls_of_op.moving.emplace_back(t, nullptr);  // memory it gets in the op is fresh (end_op)
    }
  }
}

void failed(const char* where, const std::string& op, const std::exception& e) {
  warn_once(std::string("tracking failed ") + where + " " + op,
            std::string("automatic synchronization failed ") + where + " " + op + " (" + e.what() +
                "); this op may race. Further failures of this op there are not "
                "reported.");
}

// Inside a pipeline context: the devices the op runs on join the pipeline's lane before it
// launches (context.h, enter_device): its tensors' devices and its device arguments.
void enter_devices(const c10::ArrayRef<c10::IValue>& inputs) {
  c10::Device entered(c10::kCPU);
  for (const c10::IValue& v : inputs) {
    if (v.isDevice()) {
      c10::Device d = v.toDevice();
      if (!d.is_cpu() && !d.is_meta()) {
        if (!d.has_index()) {
          d = c10::Device(d.type(), c10::impl::getDeviceGuardImpl(d.type())->getDevice().index());
        }
        enter_device(d);
      }
    } else {
      for_each_tensor(v, [&entered](const at::Tensor& x) {
        const c10::Device d = x.device();
        if (!d.is_cpu() && !d.is_meta() && d != entered) {
          enter_device(d);
          entered = d;  // (an op's tensors are mostly on one device)
        }
      });
    }
  }
}

// The accelerator devices among the op's device arguments (factories, to()), in order, each once,
// with an index-less device resolved to the current device of its type.
void device_arguments(const c10::ArrayRef<c10::IValue>& inputs, std::vector<c10::Device>& out) {
  out.clear();
  for (const c10::IValue& v : inputs) {
    if (v.isDevice() && !v.toDevice().is_cpu() && !v.toDevice().is_meta()) {
      c10::Device d = v.toDevice();
      if (!d.has_index()) {
        d = c10::Device(d.type(), c10::impl::getDeviceGuardImpl(d.type())->getDevice().index());
      }
      if (std::find(out.begin(), out.end(), d) == out.end()) {
        out.push_back(d);
      }
    }
  }
}

void begin_op(const OpFacts& facts, c10::ArrayRef<c10::IValue> inputs, bool on_device, Tls& t) {
  t.launched.clear();
  t.inputs.clear();
  t.accesses.clear();
  t.list_items.clear();
  t.list_writes.clear();
  t.moving.clear();
  t.moved.clear();
  t.empty_writes.clear();
  t.c10d_written.clear();
  t.async = false;
  t.period = 0;
  t.c10d = facts.c10d;
  t.facts = &facts;
  // The common case of CPU code: nothing on a device, no watched host memory, no pinned tensors.
  t.host_only = !on_device && !watching_host() && g_pins.load(std::memory_order_acquire) == 0;
  if (t.host_only) {
    return;
  }
  if (in_pipeline()) {
    enter_devices(inputs);
  }
  bool any_device = false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool w = writes_argument(facts, i, inputs);
    if (inputs[i].isTensor()) {
      // (the IValue lives until the start callbacks have run)
      add_tensor(inputs[i].toTensor(), w, facts.may_move, t);
    } else {
      // Tensors inside lists (torch.cat, _foreach_*) are handed out as temporaries: copied.
      for_each_tensor(inputs[i], [&](const at::Tensor& x) {
        t.list_items.push_back(x);
        t.list_writes.push_back(w);
      });
    }
  }
  for (size_t i = 0; i < t.list_items.size(); ++i) {  // (list_items stopped growing)
    add_tensor(t.list_items[i], t.list_writes[i], facts.may_move, t);
  }
  if (t.accesses.empty()) {
    // A factory: its outputs are handled at the end; its streams wait for the baseline first.
    auto& devices = t.thread_run().devices;
    device_arguments(inputs, devices);
    enter_streams(devices);  // (inside a capture the capture's state has no baseline)
    // Inside a graph capture it launches now, so a stream not in the capture yet (a side
    // pipeline's) is forked in before the op runs: else its kernel would run now, outside the
    // graph, with memory from outside the graph's pool.
    if (on_device && capturing_thread() && !devices.empty()) {
      const c10::Device target = devices.front();  // (device_launch reuses `devices`)
      device_launch(t.thread_run(), t.accesses, /*async=*/false, t.launched, t.period, target);
    }
    return;
  }
  for (const Access& a : t.accesses) {
    t.inputs.push_back(a.tensor->storage().unsafeGetStorageImpl());
    any_device |= !a.tensor->device().is_cpu();
    if (t.c10d && a.write && !a.tensor->device().is_cpu()) {
      t.c10d_written.push_back(*a.tensor);
    }
    if (a.may_move && !a.tensor->device().is_cpu()) {
      t.moving.emplace_back(*a.tensor, a.tensor->storage().data());
    }
  }
  const bool non_blocking =
      facts.non_blocking >= 0 && static_cast<size_t>(facts.non_blocking) < inputs.size() &&
      inputs[facts.non_blocking].isBool() && inputs[facts.non_blocking].toBool();
  std::optional<c10::Device> target;
  if (!any_device) {
    // Host inputs only, maybe a device argument. A non_blocking copy to a device
    // (x.to("cuda", non_blocking=True)) runs where its device argument says. A blocking one
    // (x.to("cuda"), torch.tensor(data, device=...)) has its output handled at the end, like a
    // factory's, so its streams wait for the baseline before it allocates and writes.
    auto& devices = t.thread_run().devices;
    device_arguments(inputs, devices);
    if (non_blocking && !devices.empty()) {
      target = devices.front();
    } else {
      enter_streams(devices);
    }
  }
  t.async = non_blocking && (any_device || target.has_value());
  wait_for_pins(t.accesses);
  ThreadRun& run = t.thread_run();
  if (!t.async && (watching_host() || g_pins.load(std::memory_order_acquire) > 0)) {
    t.scratch.clear();
    for (const Access& a : t.accesses) {
      if (a.tensor->device().is_cpu()) {
        t.scratch.push_back(a);
      }
    }
    if (!t.scratch.empty()) {
      host_access(t.scratch, run.reads, run.writes);
    }
  }
  if (any_device || target.has_value()) {
    device_launch(run, t.accesses, t.async, t.launched, t.period, target);
  }
}

void end_op(c10::ArrayRef<c10::IValue> outputs, Tls& t) {
  auto& fresh = t.fresh;
  fresh.clear();
  for (size_t i = 0; i < outputs.size(); ++i) {
    // An argument coming back (in-place and out= ops, set_) is fresh only with the storage it
    // went in with, which had no memory then (an out= tensor of size 0 the op resized): with
    // another one (set_ from a Storage, which no tensor input shows) it is an existing storage,
    // whose writer and readers a redefinition would drop.
    const bool aliased = i < t.facts->aliased_return.size() && t.facts->aliased_return[i] != 0;
    for_each_tensor(outputs[i], [&](const at::Tensor& x) {
      if (!has_data(x)) {
        return;
      }
      const c10::StorageImpl* storage = x.storage().unsafeGetStorageImpl();
      if (aliased && std::find(t.empty_writes.begin(), t.empty_writes.end(), storage) ==
                         t.empty_writes.end()) {
        return;
      }
      if (std::find(t.inputs.begin(), t.inputs.end(), storage) == t.inputs.end() &&
          (!x.device().is_cpu() || t.async)) {
        fresh.push_back(x);
      }
    });
  }
  if (t.c10d) {
    note_async_collective(outputs, t.c10d_written);
  }
  for (const auto& [tensor, data] : t.moving) {
    const void* now = tensor.storage().data();
    if (data == nullptr) {
      // It had no memory (resize_storage_bytes_ growing a freed storage): what it has now is
      // fresh, made on the op's stream (unless an output already said so).
      const c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
      if (now != nullptr &&
          std::none_of(fresh.tensors().begin(), fresh.tensors().end(), [&](const at::Tensor& f) {
            return f.storage().unsafeGetStorageImpl() == storage;
          })) {
        fresh.push_back(tensor);
      }
    } else if (now != data) {
      t.moved.push_back(tensor);
    }
  }
  if (t.launched.empty() && fresh.tensors().empty()) {
    return;
  }
  finish(t.thread_run(), t.launched, t.period, &fresh.tensors(),
         t.async,  // (period 0 for a factory)
         t.moved.empty() ? nullptr : &t.moved);
}

}  // namespace

bool host_memory_observed() {
  return watching_host() || g_pins.load(std::memory_order_acquire) != 0;
}

bool host_only_op(c10::ArrayRef<c10::IValue> inputs) {
  if (host_memory_observed()) {
    return false;
  }
  const bool found = std::any_of(inputs.begin(), inputs.end(), [](const c10::IValue& v) {
    if (v.isDevice()) {
      return !v.toDevice().is_cpu();
    }
    return for_each_tensor(v, [](const at::Tensor& x) { return !host_tensor(x); });
  });
  if (found) {
    return false;
  }
  count(&Counters::ops);  // (observer_progress counts it from there)
  return true;
}

Taken op_start(const OpFacts& facts, c10::ArrayRef<c10::IValue> inputs) {
  Tls& t = thread_local_ref(tls);
  ++t.level;
  bool in_region = false;
  if (t.active == kInRegion) {
    // Inside a compiled region its ops are the region's, but for a storage resize (Dynamo's
    // UntypedStorage.resize_, compiled FSDP2): its old block is freed, or a new one allocated,
    // at once, which the region's launch cannot order. It is observed as an op of its own.
    if (facts.name != kResizeStorageBytes) {
      return Taken::kInside;
    }
    in_region = true;
  } else if (t.active != 0) {
    return Taken::kInside;  // inside an observed op: its device work is on the same streams
  }
  // The outermost op *that touches real storage* is the one tracked: an op on tensors without
  // storage (torch.func transforms, wrapper subclasses) is left to the ops it calls, which are
  // observed in its place. One that calls none on a device is a gap (op_end).
  // (RecordFunctions without a schema, e.g. autograd's "detach", are not dispatcher ops: what
  // they do runs in the ops they call, if any, which are observed.)
  if (facts.transparent) {
    return in_region ? Taken::kInside : Taken::kTransparent;
  }
  ++t.observed;
  const InputScan scan = scan_inputs(inputs);
  if (scan.opaque != 0) {
    if (in_region) {
      return Taken::kInside;  // (the region's own: it is no gap)
    }
    t.unclaimed.push_back(Tls::Unclaimed{t.level, &facts, scan.opaque == 2, t.observed});
    count(&Counters::unclaimed);
    return Taken::kUnclaimed;
  }
  t.active = t.level;
  t.in_region = in_region;
  count(&Counters::ops);
  try {
    begin_op(facts, inputs, scan.on_device, t);
  } catch (const std::exception& e) {
    if (!t.launched.empty()) {
      settle(t.launched, t.period);
    }
    t.launched.clear();
    t.host_only = true;
    failed("before", facts.full_name, e);
  }
  return Taken::kClaimed;
}

void op_end(Taken taken, c10::ArrayRef<c10::IValue> outputs) {
  Tls& t = thread_local_ref(tls);
  if (t.level == 0) {
    return;  // the observer was installed while this op ran (or a fork reset this thread)
  }
  if (taken == Taken::kClaimed && t.active == t.level) {
    t.active = t.in_region ? kInRegion : 0;
    t.in_region = false;
    try {
      if (!t.host_only) {
        end_op(outputs, t);
      }
    } catch (const std::exception& e) {
      failed("after", t.facts->full_name, e);
    }
    t.launched.clear();
    t.list_items.clear();
    t.fresh.clear();
    t.moving.clear();
    t.moved.clear();
    t.c10d_written.clear();
    ThreadRun& run = t.thread_run();
    if (!run.keep_alive.empty()) {
      record_instead(run.keep_alive);  // (begin_op failed after choosing to keep alive)
    }
    install_wanted_check();  // (after every lock: Note [The sampled check is installed on demand])
  } else if (taken == Taken::kUnclaimed && !t.unclaimed.empty() &&
             t.unclaimed.back().level == t.level) {
    const Tls::Unclaimed u = t.unclaimed.back();
    t.unclaimed.pop_back();
    if (u.on_device && t.observed == u.observed) {  // it called no op the tracker could look at
      report_gap(u.facts->full_name,
                 "its tensors have no storage the tracker can follow, and it called no operator "
                 "that has");
    }
  }
  --t.level;
}

bool inside_observed_op() { return tls.active != 0; }

int observer_level() { return tls.level; }

std::pair<uint64_t, uint64_t> observer_progress() {
  const Counters& c = thread_counters();
  return {tls.regions, c.ops.load(std::memory_order_relaxed) +
                           c.unclaimed.load(std::memory_order_relaxed) + tls.observed};
}

bool begin_region() {
  if (tls.active != 0) {
    return false;
  }
  tls.active = kInRegion;
  ++tls.regions;
  return true;
}

void end_region() {
  TORCH_INTERNAL_ASSERT(tls.active == kInRegion, "a compiled region ended out of order");
  tls.active = 0;
}

void reset_observer_thread_after_fork() {
  tls.level = 0;
  tls.active = 0;
  tls.in_region = false;
  tls.unclaimed.clear();
  reset_dynamo_ranges_after_fork();
  thread_run().last = Position{};
  thread_run().keep_alive.clear();
}

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
