#include "host.h"

#include "allocator.h"
#include "fork.h"
#include "ops.h"
#include "sim.h"
#include "state.h"

#include "../runtime/ivalue_tensors.h"
#include "../runtime/op_facts.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace torch_pipeline {
namespace sim {
namespace {

thread_local bool tls_in_sim_kernel = false;
// Nesting of checked ops (those that access data): only the outermost one is checked. Views and
// queries do not count, so the ops they call are checked (p.to(dtype) is aten::to, a view op,
// around aten::_to_copy).
thread_local int tls_depth = 0;

// The marker on_op_start returns for an op it counted in tls_depth, with the op's accesses of
// pending memory. They are recorded at the op's end (Note [The host check records at the end]).
struct Counted final : at::ObserverContext {
  std::vector<Access> accesses;
};

struct PendingHostAccess {
  uintptr_t begin;
  uintptr_t end;
  Timeline timeline;  // the stream of the copy
  uint64_t epoch;     // the copy's epoch there: complete once the host clock reaches it
};

std::mutex g_mutex;
std::vector<PendingHostAccess>* g_pending = new std::vector<PendingHostAccess>();
std::atomic<size_t> g_pending_count{0};
// Note [The host check's callback stays]: installed at the first pending access and never
// removed (on_op_start returns at once while nothing is pending). Adding or removing a global
// callback makes every thread re-read torch's callback registry under torch's lock at its next
// op; a fork() during such a re-read copies that lock held and the child hangs at its first op
// (docs/design.md, "Fork"). Removing it whenever the last access completed did that on every
// non_blocking copy to the host, so a fork at any moment could hang the child.
bool g_callback_installed = false;  // (g_mutex)

// Publishes the count (g_mutex held).
void pending_changed_locked() {
  g_pending_count.store(g_pending->size(), std::memory_order_release);
}

// Removes the complete accesses (g_mutex held).
void prune_locked() {
  if (g_pending->empty()) {
    return;
  }
  const VectorClock host = State::get().checker().snapshot(kHost);
  auto& v = *g_pending;
  v.erase(std::remove_if(
              v.begin(), v.end(),
              [&](const PendingHostAccess& p) { return clock_entry(host, p.timeline) >= p.epoch; }),
          v.end());
  pending_changed_locked();
}

bool is_sim_tensor(const at::Tensor& t) { return t.defined() && t.device().type() == kSim; }

// An argument that makes the op the device's: a sim tensor, or a sim device (factories, to()).
bool is_device_argument(const c10::IValue& v) {
  if (v.isDevice()) {
    return v.toDevice().type() == kSim;
  }
  return any_tensor(v, is_sim_tensor);
}

// The accesses of host tensor `t` that touch pending memory, appended to `out`.
void check_host_tensor(const at::Tensor& t, bool write, std::vector<Access>& out) {
  if (!t.defined() || !t.device().is_cpu()) {
    return;
  }
  std::vector<Access> mine;
  if (!host_accesses(t, write, mine)) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  for (Access& a : mine) {
    const bool pending =
        std::any_of(g_pending->begin(), g_pending->end(),
                    [&](const PendingHostAccess& p) { return p.begin < a.end && a.begin < p.end; });
    if (pending) {
      out.push_back(std::move(a));
    }
  }
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  if (tls_depth > 0 || tls_in_sim_kernel || g_pending_count.load(std::memory_order_acquire) == 0) {
    return nullptr;
  }
  const OpFacts& facts = op_facts(fn);  // the tracker's facts (unknown ops are transparent)
  if (facts.transparent) {
    return nullptr;  // not counted: what it calls is checked
  }
  ++tls_depth;
  auto counted = std::make_unique<Counted>();
  const auto inputs = fn.inputs();
  if (std::any_of(inputs.begin(), inputs.end(), is_device_argument)) {
    return counted;
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool w = writes_argument(facts, i, inputs);
    for_each_tensor(inputs[i],
                    [&](const at::Tensor& t) { check_host_tensor(t, w, counted->accesses); });
  }
  return counted;
}

// Note [The host check records at the end]: the accesses found at the op's start are recorded
// at its end, against the host's clock then. Between the two run the other callbacks' starts,
// among them the tracker's, which makes the host wait for the pending copies the op touches. The
// order of RecordFunction callbacks is the order they were added in, which this check cannot
// choose (its callback stays, Note [The host check's callback stays]; the tracker's comes and
// goes with its pipelines), so recording at the start saw the copy incomplete whenever this
// callback was the earlier one. The op's own kernel runs on the host and waits for no stream.
void on_op_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (ctx == nullptr) {
    return;
  }
  --tls_depth;
  auto* counted = static_cast<Counted*>(ctx);
  if (!counted->accesses.empty()) {
    try {
      State::get().checker().record_op(kHost, std::string(fn.name()) + " (host)", counted->accesses,
                                       gather_site());
    } catch (...) {
    }
  }
}

}  // namespace

bool host_accesses(const at::Tensor& t, bool write, std::vector<Access>& out) {
  if (!t.defined() || !t.has_storage() || t.storage().data() == nullptr) {
    return false;
  }
  char buffer[96];
  std::snprintf(buffer, sizeof(buffer), "pinned host memory %p (%zu bytes)", t.storage().data(),
                t.storage().nbytes());
  const size_t before = out.size();
  add_accesses(t, write, buffer, out);
  return out.size() > before;
}

void watch_async_host_accesses(Timeline t, const std::vector<Access>& accesses) {
  if (accesses.empty()) {
    return;
  }
  const uint64_t epoch = clock_entry(State::get().checker().snapshot(t), t);
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const Access& a : accesses) {
    g_pending->push_back(PendingHostAccess{a.begin, a.end, t, epoch});
  }
  if (!g_callback_installed) {
    at::addGlobalCallback(at::RecordFunctionCallback(&on_op_start, &on_op_end)
                              .needsInputs(true)
                              .scopes({at::RecordScope::FUNCTION}));
    g_callback_installed = true;
  }
  pending_changed_locked();
}

void prune_async_host_accesses() {
  if (g_pending_count.load(std::memory_order_acquire) == 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  prune_locked();
}

void forget_async_host_accesses(uintptr_t begin, uintptr_t end) {
  if (g_pending_count.load(std::memory_order_acquire) == 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& v = *g_pending;
  v.erase(
      std::remove_if(v.begin(), v.end(),
                     [&](const PendingHostAccess& p) { return p.begin < end && begin < p.end; }),
      v.end());
  pending_changed_locked();
}

size_t pending_host_accesses() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_pending->size();
}

void lock_host_for_fork() { g_mutex.lock(); }

void unlock_host_after_fork() { g_mutex.unlock(); }

SimKernelScope::SimKernelScope() : previous_(tls_in_sim_kernel) { tls_in_sim_kernel = true; }

SimKernelScope::~SimKernelScope() { tls_in_sim_kernel = previous_; }

}  // namespace sim
}  // namespace torch_pipeline
