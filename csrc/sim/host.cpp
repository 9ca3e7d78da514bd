#include "host.h"

#include "allocator.h"
#include "state.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace torch_pipeline {
namespace sim {
namespace {

thread_local bool tls_in_sim_kernel = false;
thread_local int tls_depth = 0;  // nesting of observed ops: only the outermost one is checked

struct PendingHostAccess {
  uintptr_t begin;
  uintptr_t end;
  Timeline timeline;  // the stream of the copy
  uint64_t epoch;     // the copy's epoch there: complete once the host clock reaches it
};

std::mutex g_mutex;
std::vector<PendingHostAccess>* g_pending = new std::vector<PendingHostAccess>();
std::atomic<size_t> g_pending_count{0};
std::optional<at::CallbackHandle> g_callback;  // installed while accesses are pending

uint64_t entry(const VectorClock& clock, Timeline t) {
  return static_cast<size_t>(t) < clock.size() ? clock[static_cast<size_t>(t)] : 0;
}

// Removes the complete accesses; uninstalls the callback when none is left (g_mutex held).
void prune_locked() {
  if (g_pending->empty()) {
    return;
  }
  const VectorClock host = State::get().checker().snapshot(kHost);
  auto& v = *g_pending;
  v.erase(std::remove_if(v.begin(), v.end(), [&](const PendingHostAccess& p) {
            return entry(host, p.timeline) >= p.epoch;
          }), v.end());
  g_pending_count.store(v.size(), std::memory_order_release);
  if (v.empty() && g_callback.has_value()) {
    at::removeCallback(*g_callback);
    g_callback.reset();
  }
}

struct HostOpFacts {
  std::vector<char> write;  // per argument
  bool metadata_only = false;
};

const HostOpFacts& facts_of(const c10::OperatorName& name) {
  static std::mutex mutex;
  static auto* cache = new std::unordered_map<c10::OperatorName, HostOpFacts>();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache->find(name);
  if (it == cache->end()) {
    HostOpFacts f;
    bool any_write = false;
    bool all_views = false;
    if (auto op = c10::Dispatcher::singleton().findSchema(name)) {
      const auto& schema = op->schema();
      for (const auto& arg : schema.arguments()) {
        const auto* ai = arg.alias_info();
        const bool w = ai != nullptr && ai->isWrite();
        f.write.push_back(w ? 1 : 0);
        any_write |= w;
      }
      all_views = !schema.returns().empty();
      for (const auto& ret : schema.returns()) {
        const auto* ai = ret.alias_info();
        all_views &= ai != nullptr && !ai->isWrite();
      }
    }
    static const char* const kMetadata[] = {"aten::is_pinned", "aten::is_set_to",
                                            "aten::record_stream", "aten::_pin_memory"};
    f.metadata_only = (all_views && !any_write) ||
        std::any_of(std::begin(kMetadata), std::end(kMetadata),
                    [&](const char* m) { return name.name == m; });
    it = cache->emplace(name, std::move(f)).first;
  }
  return it->second;
}

void check_host_tensor(const at::Tensor& t, bool write, std::vector<Access>& out) {
  if (!t.defined() || !t.device().is_cpu()) {
    return;
  }
  Access a;
  if (!host_access(t, write, &a)) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const auto& p : *g_pending) {
    if (p.begin < a.end && a.begin < p.end) {
      out.push_back(std::move(a));
      return;
    }
  }
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  if (tls_depth++ > 0 || tls_in_sim_kernel ||
      g_pending_count.load(std::memory_order_acquire) == 0) {
    return nullptr;
  }
  const auto name = fn.operator_name();
  if (!name.has_value()) {
    return nullptr;
  }
  const HostOpFacts& facts = facts_of(*name);
  if (facts.metadata_only) {
    return nullptr;
  }
  const std::vector<char>& write = facts.write;
  std::vector<Access> accesses;
  const auto inputs = fn.inputs();
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool w = i < write.size() && write[i] != 0;
    const c10::IValue& v = inputs[i];
    if (v.isTensor()) {
      check_host_tensor(v.toTensor(), w, accesses);
    } else if (v.isTensorList()) {
      for (const at::Tensor& x : v.toTensorList()) {
        check_host_tensor(x, w, accesses);
      }
    }
  }
  if (!accesses.empty()) {
    try {
      std::string op = fn.name();
      State::get().checker().record_op(kHost, op + " (host)", accesses);
    } catch (...) {
    }
  }
  return nullptr;
}

void on_op_end(const at::RecordFunction&, at::ObserverContext*) {
  --tls_depth;
}

}  // namespace

bool host_access(const at::Tensor& t, bool write, Access* out) {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) {
    return false;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.storage().data());
  if (base == 0) {
    return false;
  }
  int64_t lo = t.storage_offset();
  int64_t hi = lo;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t extent = (t.size(d) - 1) * t.stride(d);
    (extent >= 0 ? hi : lo) += extent;
  }
  const auto item = static_cast<int64_t>(t.element_size());
  out->begin = base + static_cast<uintptr_t>(lo * item);
  out->end = base + static_cast<uintptr_t>((hi + 1) * item);
  out->write = write;
  char buffer[96];
  std::snprintf(buffer, sizeof(buffer), "pinned host memory %p (%zu bytes)", t.storage().data(),
                t.storage().nbytes());
  out->memory = buffer;
  return true;
}

void watch_async_host_access(Timeline t, const Access& access) {
  const VectorClock clock = State::get().checker().snapshot(t);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_pending->push_back(PendingHostAccess{access.begin, access.end, t, entry(clock, t)});
  g_pending_count.store(g_pending->size(), std::memory_order_release);
  if (!g_callback.has_value()) {
    g_callback = at::addGlobalCallback(at::RecordFunctionCallback(&on_op_start, &on_op_end)
                                           .needsInputs(true)
                                           .scopes({at::RecordScope::FUNCTION}));
  }
}

void prune_async_host_accesses() {
  if (g_pending_count.load(std::memory_order_acquire) == 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  prune_locked();
}

SimKernelScope::SimKernelScope() : previous_(tls_in_sim_kernel) {
  tls_in_sim_kernel = true;
}

SimKernelScope::~SimKernelScope() {
  tls_in_sim_kernel = previous_;
}

}  // namespace sim
}  // namespace torch_pipeline
