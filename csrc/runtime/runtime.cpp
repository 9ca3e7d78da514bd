#include "runtime.h"

#include "settings.h"
#include "streams.h"
#include "warn.h"

#include <c10/util/Exception.h>

#include <pthread.h>

#include <atomic>
#include <sstream>
#include <string>

namespace torch_pipeline {
namespace {

// ---- the worker-thread cap -------------------------------------------------------------------
std::atomic<int> g_cap{0};  // 0: not read yet
std::atomic<bool> g_cap_frozen{false};

constexpr const char* kCapEnv = "TORCH_PIPELINE_MAX_WORKER_THREADS";

int cap_from_env() {
  return static_cast<int>(
      settings::env_int(kCapEnv, 1, kMaxWorkerThreadsLimit, kDefaultMaxWorkerThreads));
}

// ---- the runtime of the current generation ---------------------------------------------------
std::atomic<uint64_t> g_generation{1};
std::atomic<Runtime*> g_runtime{nullptr};
std::function<void()>* g_idle_hook = nullptr;  // set once, before any worker starts

struct ForkHandlerRegistration {
  ForkHandlerRegistration() { pthread_atfork(nullptr, nullptr, &start_new_generation); }
} fork_handler_registration;

std::mutex& creation_mutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}

std::tuple<int, int, c10::StreamId> stream_key(const c10::Stream& s) {
  return {static_cast<int>(s.device_type()), static_cast<int>(s.device_index()), s.id()};
}

}  // namespace

void start_new_generation() {
  // Runs in the child after fork(), where only the forking thread exists. The parent's runtime
  // (its threads gone, its locks possibly held) is left untouched and leaked; the child gets a
  // fresh one, built here so that no lock of the parent's is ever taken.
  const uint64_t generation = g_generation.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (g_runtime.load(std::memory_order_acquire) != nullptr) {
    g_runtime.store(new Runtime(generation), std::memory_order_release);
  }
}

int max_worker_threads() {
  int cap = g_cap.load(std::memory_order_acquire);
  if (cap == 0) {
    int expected = 0;
    const int from_env = cap_from_env();
    g_cap.compare_exchange_strong(expected, from_env, std::memory_order_acq_rel);
    cap = g_cap.load(std::memory_order_acquire);
  }
  return cap;
}

void set_max_worker_threads(int n) {
  TORCH_CHECK_VALUE(n >= 1 && n <= kMaxWorkerThreadsLimit, "max worker threads must be in [1, ",
                    kMaxWorkerThreadsLimit, "], got ", n);
  if (g_cap_frozen.load(std::memory_order_acquire)) {
    TORCH_CHECK(n == g_cap.load(std::memory_order_acquire), "set_max_worker_threads(", n,
                ") called after the worker threads came into use with a cap of ", g_cap.load(),
                ": call it before the first Pipeline, get_worker_thread() or submit()");
    return;
  }
  g_cap.store(n, std::memory_order_release);
}

Runtime& Runtime::get() {
  Runtime* rt = g_runtime.load(std::memory_order_acquire);
  if (rt != nullptr) {
    return *rt;
  }
  std::lock_guard<std::mutex> lock(creation_mutex());
  rt = g_runtime.load(std::memory_order_acquire);
  if (rt == nullptr) {
    rt = new Runtime(g_generation.load(std::memory_order_acquire));  // leaked on purpose
    g_runtime.store(rt, std::memory_order_release);
  }
  return *rt;
}

uint64_t Runtime::current_generation() { return g_generation.load(std::memory_order_acquire); }

void Runtime::set_idle_hook(std::function<void()> hook) {
  TORCH_INTERNAL_ASSERT(g_idle_hook == nullptr, "idle hook set twice");
  g_idle_hook = new std::function<void()>(std::move(hook));
}

Runtime::Runtime(uint64_t generation)
    : generation_(generation),
      default_(std::make_shared<PipelineImpl>(nullptr, 0, 0, 0, generation)) {}

core::WorkerPool& Runtime::pool() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!pool_) {
    const int cap = max_worker_threads();
    g_cap_frozen.store(true, std::memory_order_release);
    core::set_error_report([](const std::string& message) { warn(message); });
    pool_ = std::make_unique<core::WorkerPool>(
        cap, g_idle_hook != nullptr ? *g_idle_hook : std::function<void()>());
  }
  return *pool_;
}

void Runtime::check_worker_id(int id) {
  const int cap = pool().cap();
  TORCH_CHECK_VALUE(
      id >= 0 && id < cap, "worker thread id ", id, " is out of range: the cap is ", cap,
      " worker threads (ids 0..", cap - 1,
      "); raise it with torch_pipeline.set_max_worker_threads(n) before first use, or with the "
      "environment variable ",
      kCapEnv);
}

core::WorkerThread& Runtime::worker(int id) {
  check_worker_id(id);
  return pool().worker(id);
}

std::vector<core::WorkerThread*> Runtime::workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pool_) {
      return {};
    }
  }
  return pool().created();
}

std::vector<Runtime::SlotStream> Runtime::slot_streams() {
  std::vector<SlotTable*> tables;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [key, table] : tables_) {
      tables.push_back(table.get());
    }
  }
  std::vector<SlotStream> out;
  for (SlotTable* table : tables) {  // (tables live as long as the runtime)
    for (const auto& [slot, streams] : table->all_streams()) {
      for (const auto& [device, stream] : streams) {
        out.push_back(SlotStream{table->worker_id(), table->priority(), slot, stream});
      }
    }
  }
  return out;
}

PipelinePtr Runtime::create_pipeline(int worker_id, int priority) {
  check_worker_id(worker_id);
  if (priority != 0) {  // (0, the default and lowest, is in every range)
    const PriorityRange range = pipeline_priority_range();
    TORCH_CHECK_VALUE(priority >= range.greatest && priority <= range.least, "Pipeline priority ",
                      priority, " is outside the range of ", range.source, ": ", range.least,
                      " (lowest, the default) to ", range.greatest,
                      " (highest); lower numbers are higher priority, as in torch.cuda.Stream");
  }
  SlotTable* table = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = tables_[{worker_id, priority}];
    if (!slot) {
      slot = std::make_unique<SlotTable>(worker_id, priority);
    }
    table = slot.get();
  }
  const int64_t id = table->acquire();
  try {
    return std::make_shared<PipelineImpl>(table, id, worker_id, priority, generation_);
  } catch (...) {
    table->release(id);
    throw;
  }
}

c10::Stream Runtime::comm_stream(int worker_id, const c10::Device& device) {
  check_worker_id(worker_id);
  const auto key =
      std::make_tuple(worker_id, static_cast<int>(device.type()), static_cast<int>(device.index()));
  c10::Stream out = c10::Stream(c10::Stream::DEFAULT, device);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = comm_streams_.find(key);
    if (it != comm_streams_.end()) {
      return it->second;
    }
    out = new_stream(device, 0);  // under the lock: an exclusive stream is never made twice
    comm_streams_.emplace(key, out);
  }
  note_live_stream(out);  // lives as long as the process: warns if a pipeline aliases it
  return out;
}

void Runtime::note_live_stream(const c10::Stream& stream) {
  if (has_exclusive_streams(stream.device_type())) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (++live_streams_[stream_key(stream)] != 2) {
      return;
    }
  }
  std::ostringstream os;
  os << "two live pipelines share stream " << stream.id() << " on " << stream.device()
     << ": this build draws streams from PyTorch's fixed stream pool, which hands the same stream "
        "out again once it is exhausted. Their work is serialized (correct, but without "
        "overlap). Keep fewer pipelines alive per device and priority, or install torch_pipeline "
        "with CUDA support (exclusive streams).";
  warn_once("shared pool stream", os.str());
}

void Runtime::note_dead_stream(const c10::Stream& stream) {
  if (has_exclusive_streams(stream.device_type())) {
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_streams_.find(stream_key(stream));
  if (it != live_streams_.end() && --it->second == 0) {
    live_streams_.erase(it);
  }
}

}  // namespace torch_pipeline
