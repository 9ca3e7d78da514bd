// The dispatcher path of the observer module (Note [Two ways to observe ops] in observer.h): a
// boxed fallback on a thread-local mode key, the key's place in each thread's dispatch key set, and
// the checks that notice device ops of threads without it. Touches only the observer's switches and
// counters; what an op means to the tracker is observer.cpp's.
//
// Note [The observer's dispatch keys]: PyTorch has no dispatch key for out-of-tree modes, so the
// observer takes two keys no PyTorch code includes or registers a fallback for (if something
// else did, registration fails and the RecordFunction path is used):
// * TESTING_ONLY_GenericMode, the observer's key in each observed thread's included set. It sits
//   above every other key but PreDispatch and PythonDispatcher (tracing only), so the fallback
//   sees the op a user called, before autograd, autocast, functorch and the Python key, as a
//   RecordFunction would. An observed op runs with the keys excluded, so its callees never reach
//   the fallback (nor, as PythonTLSSnapshot keeps that exclusion, the ops a dispatch mode's
//   __torch_dispatch__ runs for it).
// * CustomRNGKeyId, below the Python key, included only while an op whose tensors have no
//   storage runs (a wrapper subclass such as DTensor, a torch.func wrapper: unclaimed, left to
//   the ops it calls). The Python key's fallback excludes every key above it before it calls
//   __torch_dispatch__ (PythonFallbackKernel.cpp), the mode key too, so the real ops inside are
//   seen at this one. Being a backend-like key, it runs an op's CompositeExplicitAutograd kernel
//   before the fallback, whose callees are then seen instead. It is the key of custom RNG
//   generators (csprng): their own kernels still run; an op with such a generator and no kernel
//   for it reaches the fallback and then fails in the CPU kernel, as it would have failed here.
// at::ThreadLocalState carries the key set, so the autograd engine's threads run a backward with
// the key of the thread that called it.
#include "observe_dispatch.h"
#include "../warn.h"
#include "observer.h"
#include "state.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <pthread.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

namespace torch_pipeline {
namespace tracking {
namespace detail {

namespace {

// The sampled RecordFunction check of threads without the key: the share of events it sees, on
// average, of every thread (set_unobserved_checks changes it for tests); and whether backends'
// checks (device_op_seen) run.
std::atomic<double> g_check_sampling{1.0 / 64};
std::atomic<bool> g_backend_check{true};
// The device types whose backend checks every device op (set_backend_checks), a bit each.
std::atomic<uint64_t> g_checked_types{0};

std::atomic<uint64_t> g_generation{0};  // bumped at each go-live of this path

bool keyed(const c10::impl::LocalDispatchKeySet& local) {
  return local.included_.has(kObserverKey) || local.excluded_.has(kObserverKey) ||
         local.included_.has(kInnerKey);
}

void run_op(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack,
            Taken taken) {
  run_taken(taken, [&] { op.redispatchBoxed(below, stack); });
}

// Both keys' fallback (`key` is the one it was reached at).
template <c10::DispatchKey key>
void observe_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                      torch::jit::Stack* stack) {
  const c10::DispatchKeySet below =
      keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, key);
  if (!g_dispatch_observing.load(std::memory_order_acquire)) {
    // Tracking is idle: this thread stops paying for the key (observe_this_thread and the
    // sweep of Python threads put it back when tracking goes live again).
    c10::impl::tls_set_dispatch_key_included(kObserverKey, false);
    op.redispatchBoxed(below, stack);
    return;
  }
  const size_t nargs = op.schema().arguments().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= nargs);
  const c10::ArrayRef<c10::IValue> inputs(stack->data() + stack->size() - nargs, nargs);
  if (host_only_op(inputs)) {  // (inside a compiled region too: nothing to observe)
    run_op(op, below, stack, Taken::kClaimed);
    return;
  }
  const OpFacts& facts = op_facts(op);
  // The tracker's own work runs with both keys excluded, and so do the callees of an op it claims
  // (run_taken): for such an op one exclusion covers op_start, the op and op_end.
  std::optional<c10::impl::ExcludeDispatchKeyGuard> tracker_ops(std::in_place, kBothKeys);
  const Taken taken = op_start(facts, inputs);
  const bool excluded = taken == Taken::kClaimed || taken == Taken::kInside;
  if (!excluded) {
    tracker_ops.reset();
  }
  try {
    if (excluded) {
      op.redispatchBoxed(below, stack);
    } else {
      run_op(op, below, stack, taken);
    }
  } catch (...) {
    if (!excluded) {
      tracker_ops.emplace(kBothKeys);
    }
    op_end(taken, {});
    throw;
  }
  const size_t nret = op.schema().returns().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= nret);
  if (!excluded) {
    tracker_ops.emplace(kBothKeys);
  }
  op_end(taken, c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - nret, nret));
}

// The live period (g_generation) in which this thread last took the key.
thread_local uint64_t t_keyed_in = 0;

void take_key() {
  c10::impl::tls_set_dispatch_key_included(kObserverKey, true);
  t_keyed_in = g_generation.load(std::memory_order_relaxed);
}

// Counts and warns (once) about a device op of a thread the dispatcher path does not observe,
// and observes that thread from now on.
void unobserved(const char* op) {
  count(&Counters::unobserved);
  char name[32] = "?";
  pthread_getname_np(pthread_self(), name, sizeof(name));
  if (t_keyed_in == g_generation.load(std::memory_order_relaxed)) {
    // It had the key in this live period, and a guard that restores a saved dispatch key set
    // (torch.inference_mode's exit, for one) took it away.
    warn_once("thread lost its key",
              std::string("thread ") + name + " ran " + op +
                  " on a device without automatic synchronization observing it: it was "
                  "observed until a guard that restores a saved dispatch key set (the exit of a "
                  "torch.inference_mode block in which a pipeline was created, for one) removed "
                  "the observer's key, so its ops since were not ordered against other "
                  "pipelines. It is observed again from now on. Create pipelines outside such "
                  "blocks, or enter a pipeline context (tp.pipeline) after them. Warned once.");
  } else {
    warn_once("unobserved thread",
              std::string("a thread the tracker did not know (") + name + ") ran " + op +
                  " on a device while automatic synchronization was live, so its ops so far "
                  "were not ordered against other pipelines. It is observed from now on. "
                  "Threads torch_pipeline knows are observed from their first op: those that "
                  "create or enter a pipeline or submit a task, its worker threads, the autograd "
                  "engine's threads, and Python threads (one that was running already, from its "
                  "next Python call). For a thread started in C++, run a Python call or a "
                  "pipeline context on it first, or set TORCH_PIPELINE_OBSERVER=record_function "
                  "to observe every thread at a higher cost per op. Warned once.");
  }
  take_key();
}

std::unique_ptr<at::ObserverContext> sampled_check(const at::RecordFunction& fn) {
  if (!g_dispatch_observing.load(std::memory_order_relaxed) ||
      keyed(c10::impl::tls_local_dispatch_key_set())) {
    return nullptr;
  }
  for (const c10::IValue& v : fn.inputs()) {
    const bool on_device = (v.isTensor() && v.toTensor().defined() &&
                            !v.toTensor().device().is_cpu() && !v.toTensor().is_meta()) ||
                           (v.isDevice() && !v.toDevice().is_cpu() && !v.toDevice().is_meta());
    if (on_device) {
      unobserved(fn.name());
      break;
    }
  }
  return nullptr;
}

}  // namespace

void observe_boxed(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                   torch::jit::Stack* stack) {
  observe_fallback<kObserverKey>(op, keys, stack);
}

bool register_dispatch_observer() {
  static const bool ok = [] {
    try {
      // (the libraries are never destroyed: the fallbacks stay for the process)
      auto* outer = new torch::Library(torch::Library::IMPL, "_", kObserverKey, __FILE__, __LINE__);
      auto* inner = new torch::Library(torch::Library::IMPL, "_", kInnerKey, __FILE__, __LINE__);
      outer->fallback(torch::CppFunction::makeFromBoxedFunction<&observe_fallback<kObserverKey>>());
      inner->fallback(torch::CppFunction::makeFromBoxedFunction<&observe_fallback<kInnerKey>>());
      auto* unboxed =
          new torch::Library(torch::Library::IMPL, "aten", kObserverKey, __FILE__, __LINE__);
      register_unboxed_kernels(*unboxed);
      return true;
    } catch (const std::exception& e) {
      warn(std::string("the dispatcher path of automatic synchronization is not available (") +
           e.what() + "); every op is observed through RecordFunction instead, which costs more");
      return false;
    }
  }();
  return ok;
}

at::CallbackHandle add_sampled_check() {
  return at::addGlobalCallback(at::RecordFunctionCallback(&sampled_check)
                                   .needsInputs(true)
                                   .samplingProb(g_check_sampling.load())
                                   .scopes({at::RecordScope::FUNCTION}));
}

bool backend_checks(c10::DeviceType type) {
  const auto bit = static_cast<unsigned>(type);
  return bit < 64 && g_backend_check.load(std::memory_order_relaxed) &&
         (g_checked_types.load(std::memory_order_relaxed) >> bit & 1) != 0;
}

void dispatch_observing_started() {
  g_generation.fetch_add(1, std::memory_order_acq_rel);
  g_dispatch_observing.store(true, std::memory_order_release);
}

}  // namespace detail

namespace {
// -1: not chosen yet (TORCH_PIPELINE_OBSERVER is read at the first go-live).
std::atomic<int> g_observer{-1};
}  // namespace

void set_observer(Observer observer) {
  TORCH_CHECK(!live(),
              "the observer of automatic synchronization cannot change while tracking is live "
              "(a non-default pipeline or a task's pinned tensors alive); change it before "
              "creating the first pipeline");
  g_observer.store(static_cast<int>(observer));
}

Observer observer() {
  int chosen = g_observer.load();
  if (chosen < 0) {
    const char* env = std::getenv("TORCH_PIPELINE_OBSERVER");
    const std::string value = env == nullptr ? "" : env;
    Observer o = Observer::kDispatcher;
    if (value == "record_function") {
      o = Observer::kRecordFunction;
    } else {
      TORCH_CHECK_VALUE(value.empty() || value == "dispatcher",
                        "TORCH_PIPELINE_OBSERVER must be 'dispatcher' (the default: a dispatcher "
                        "fallback on a thread-local key, paid once per observed op) or "
                        "'record_function' (a global RecordFunction callback, paid on every "
                        "operator call of every thread), got '",
                        value, "'");
    }
    int expected = -1;
    g_observer.compare_exchange_strong(expected, static_cast<int>(o));
    chosen = g_observer.load();
  }
  return static_cast<Observer>(chosen);
}

void observe_this_thread() {
  using namespace detail;
  if (g_dispatch_observing.load(std::memory_order_acquire) &&
      !c10::impl::tls_is_dispatch_key_included(kObserverKey)) {
    take_key();
  }
}

std::pair<bool, bool> observer_key_state() {
  return {c10::impl::tls_is_dispatch_key_included(detail::kObserverKey),
          c10::impl::tls_is_dispatch_key_excluded(detail::kObserverKey)};
}

void set_thread_hidden(bool hidden) {
  c10::impl::tls_set_dispatch_key_excluded(detail::kObserverKey, hidden);
  c10::impl::tls_set_dispatch_key_excluded(detail::kInnerKey, hidden);
}

uint64_t observed_generation() {
  return detail::g_dispatch_observing.load(std::memory_order_acquire)
             ? detail::g_generation.load(std::memory_order_acquire)
             : 0;
}

void forget_this_thread() { c10::impl::tls_set_dispatch_key_included(detail::kObserverKey, false); }

void set_unobserved_checks(double sampling, bool backend) {
  TORCH_CHECK_VALUE(sampling > 0.0 && sampling <= 1.0, "sampling must be in (0, 1], got ",
                    sampling);
  detail::g_check_sampling.store(sampling);
  detail::g_backend_check.store(backend);
}

void set_backend_checks(c10::DeviceType type) {
  const auto bit = static_cast<unsigned>(type);
  TORCH_INTERNAL_ASSERT(bit < 64, "device type ", static_cast<int>(type), " out of range");
  detail::g_checked_types.fetch_or(uint64_t{1} << bit);
}

void device_op_seen(const char* op) {
  using namespace detail;
  if (g_dispatch_observing.load(std::memory_order_relaxed) &&
      g_backend_check.load(std::memory_order_relaxed) &&
      !keyed(c10::impl::tls_local_dispatch_key_set())) {
    unobserved(op);
  }
}

}  // namespace tracking
}  // namespace torch_pipeline
