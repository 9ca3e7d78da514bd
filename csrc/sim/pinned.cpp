// The sim device's pinned host memory: a caching host allocator, registered with ATen as
// PrivateUse1's (at::getHostAllocator, which torch.accelerator.empty_host_cache calls) and served
// by the hooks to pin_memory() and non_blocking copies to the host.
//
// Like CUDA's caching host allocator: sizes are rounded up to a power of two, a freed block goes
// back to the cache of its size and is handed out again, and empty_cache() gives the cached blocks
// back to the system. A block is never handed out while a queued copy may still use it: a
// non_blocking copy's closure holds its host tensor until the copy ran (copy.cpp; finished
// closures are destroyed on host threads), which stands for the event CUDA's copy records with
// record_event(), so there is no event to record here. A freed block is complete for the race
// checker too: its history is forgotten then, as when the memory went back to the system.
#include "allocator.h"

#include "fork.h"
#include "host.h"
#include "sim.h"
#include "state.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/util/Exception.h>
#include <c10/util/llvmMathExtras.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace sim {
namespace {

constexpr size_t kMinBlock = 64;  // the alignment of every block

int64_t microseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                               start)
      .count();
}

struct PinnedBlock {
  void* ptr = nullptr;
  size_t size = 0;  // rounded
};

// Guards everything below (taken around fork(): fork.h).
std::mutex g_pinned_mutex;
// Leaked: deleters may run at exit.
std::map<uintptr_t, PinnedBlock*>& g_blocks = *new std::map<uintptr_t, PinnedBlock*>();  // all
std::map<size_t, std::vector<PinnedBlock*>>& g_free =
    *new std::map<size_t, std::vector<PinnedBlock*>>();  // size -> cached, most recent last
at::HostStats& g_stats = *new at::HostStats();

// The previous uses of [p, p + n) are complete: the race checker and the host-side check forget
// them (never throws: it runs in a deleter).
void forget_history(void* ptr, size_t n) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  try {
    forget_async_host_accesses(p, p + n);
    State::get().checker().forget(p, p + n);
  } catch (...) {
  }
}

void free_pinned(void* ctx) {
  auto* block = static_cast<PinnedBlock*>(ctx);
  // Before the block can be handed out again, and without g_pinned_mutex: the host check's and
  // the race checker's locks are taken here, and no lock nests under this one.
  forget_history(block->ptr, block->size);
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  g_stats.active_requests.decrease(1);
  g_stats.active_bytes.decrease(block->size);
  g_free[block->size].push_back(block);
}

class SimHostAllocator final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
    }
    const size_t size = std::max<size_t>(kMinBlock, c10::llvm::PowerOf2Ceil(n));
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    PinnedBlock* block = nullptr;
    auto it = g_free.find(size);
    if (it != g_free.end() && !it->second.empty()) {
      block = it->second.back();
      it->second.pop_back();
    } else {
      const auto start = std::chrono::steady_clock::now();
      void* ptr = std::aligned_alloc(kMinBlock, size);
      TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr, "out of pinned host memory (", n,
                       " bytes)");
      g_stats.host_alloc_time.increase(microseconds_since(start));
      block = new PinnedBlock();
      block->ptr = ptr;
      block->size = size;
      g_blocks.emplace(reinterpret_cast<uintptr_t>(ptr), block);
      g_stats.allocations.increase(1);
      g_stats.allocated_bytes.increase(size);
      ++g_stats.num_host_alloc;
    }
    g_stats.active_requests.increase(1);
    g_stats.active_bytes.increase(size);
    return c10::DataPtr(block->ptr, block, &free_pinned, c10::Device(c10::kCPU));
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;  // the deleter needs the block, not the pointer
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool record_event(void*, void*, c10::Stream) override {
    return false;  // nothing to record: queued copies hold their host tensors (see above)
  }

  void empty_cache() override {
    std::vector<PinnedBlock*> released;
    {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      for (auto& entry : g_free) {
        for (PinnedBlock* b : entry.second) {
          g_blocks.erase(reinterpret_cast<uintptr_t>(b->ptr));
          g_stats.allocations.decrease(1);
          g_stats.allocated_bytes.decrease(b->size);
          ++g_stats.num_host_free;
          released.push_back(b);
        }
      }
      g_free.clear();
    }
    std::vector<int64_t> free_times;
    free_times.reserve(released.size());
    for (PinnedBlock* b : released) {
      const auto start = std::chrono::steady_clock::now();
      std::free(b->ptr);  // (its history was forgotten when it was freed)
      free_times.push_back(microseconds_since(start));
      delete b;
    }
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    for (const int64_t us : free_times) {
      g_stats.host_free_time.increase(us);
    }
  }

  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    return g_stats;
  }

  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    for (auto* s : stats_locked()) {
      s->reset_accumulated();
    }
    g_stats.host_alloc_time.reset_accumulated();
    g_stats.host_free_time.reset_accumulated();
    g_stats.num_host_alloc = 0;
    g_stats.num_host_free = 0;
  }

  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    for (auto* s : stats_locked()) {
      s->reset_peak();
    }
    g_stats.host_alloc_time.reset_peak();
    g_stats.host_free_time.reset_peak();
  }

 private:
  static std::vector<c10::CachingAllocator::Stat*> stats_locked() {
    return {&g_stats.active_requests, &g_stats.active_bytes, &g_stats.allocations,
            &g_stats.allocated_bytes};
  }
};

}  // namespace

at::HostAllocator* host_allocator() {
  static SimHostAllocator* a = new SimHostAllocator();  // leaked: deleters may run at exit
  return a;
}

bool is_pinned(const void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  auto it = g_blocks.upper_bound(p);
  if (it == g_blocks.begin()) {
    return false;
  }
  --it;
  return p < it->first + it->second->size;
}

void empty_host_cache() { host_allocator()->empty_cache(); }

std::vector<std::pair<std::string, int64_t>> host_memory_stats() {
  const at::HostStats s = host_allocator()->get_stats();
  std::vector<std::pair<std::string, int64_t>> out;
  const std::pair<const char*, const c10::CachingAllocator::Stat*> stats[] = {
      {"active_requests", &s.active_requests},
      {"active_bytes", &s.active_bytes},
      {"allocations", &s.allocations},
      {"allocated_bytes", &s.allocated_bytes}};
  for (const auto& [name, stat] : stats) {
    const std::string prefix = std::string(name) + ".";
    out.emplace_back(prefix + "current", stat->current);
    out.emplace_back(prefix + "peak", stat->peak);
    out.emplace_back(prefix + "allocated", stat->allocated);
    out.emplace_back(prefix + "freed", stat->freed);
  }
  // (as torch.cuda.host_memory_stats() names them: the time of the system's allocations and frees)
  const std::pair<const char*, const decltype(s.host_alloc_time)*> times[] = {
      {"host_alloc_time", &s.host_alloc_time}, {"host_free_time", &s.host_free_time}};
  for (const auto& [name, stat] : times) {
    const std::string prefix = std::string(name) + ".";
    out.emplace_back(prefix + "total", stat->total);
    out.emplace_back(prefix + "max", stat->max);
    out.emplace_back(prefix + "min", stat->min);
    out.emplace_back(prefix + "count", stat->count);
    out.emplace_back(prefix + "avg", stat->count == 0 ? 0 : stat->total / stat->count);
  }
  out.emplace_back("num_host_alloc", s.num_host_alloc);
  out.emplace_back("num_host_free", s.num_host_free);
  return out;
}

void lock_pinned_for_fork() { g_pinned_mutex.lock(); }

void unlock_pinned_after_fork() { g_pinned_mutex.unlock(); }

}  // namespace sim
}  // namespace torch_pipeline
