#include "allocator.h"

#include "executor.h"
#include "fork.h"
#include "names.h"
#include "sim.h"
#include "state.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_set>

namespace torch_pipeline {
namespace sim {
namespace {

constexpr size_t kAlignment = 512;  // CUDA's minimum block size
constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

thread_local std::vector<Access>* tls_reuse_sink = nullptr;

struct Block {
  void* ptr = nullptr;
  size_t size = 0;
  c10::DeviceIndex device = 0;
  c10::StreamId stream = 0;    // the stream it was allocated on (its pool)
  std::vector<Timeline> uses;  // other streams it was recorded on (record_stream)
  bool allocated = false;
};

// A freed block held back until the uses recorded on other streams complete.
struct Pending {
  Block* block;
  VectorClock completed;  // the recorded streams' clocks when the block was freed, joined
  // Asynchronous mode: the uses' streams and their queue positions when the block was freed (the
  // "events"); the block returns to its pool once every one is reached.
  std::vector<std::pair<Timeline, uint64_t>> marks;
};

void free_block(void* ctx);

size_t round_up(size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

class SimAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex d = check_device(-1);
    const c10::Device device(kSim, d);
    if (n == 0) {
      return c10::DataPtr(nullptr, device);
    }
    const c10::Stream stream = current_stream(d);
    const Timeline t = State::get().timeline(stream);
    const size_t size = round_up(n);
    Block* block = nullptr;
    bool reused = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      process_pending_locked(d);
      auto& pool = pools_[{d, stream.id()}];
      // Best fit by size; among blocks of that size the most recently freed one.
      auto it = pool.lower_bound(size);
      if (it != pool.end() && it->first <= 2 * size) {
        block = it->second.back();
        it->second.pop_back();
        if (it->second.empty()) {
          pool.erase(it);
        }
        reused = true;
      } else {
        void* ptr = std::aligned_alloc(kAlignment, size);
        if (ptr == nullptr) {
          TORCH_CHECK_WITH(OutOfMemoryError, false, "sim:", static_cast<int>(d),
                           ": out of host memory "
                           "allocating ",
                           size, " bytes");
        }
        block = new Block();
        block->ptr = ptr;
        block->size = size;
        block->device = d;
        block->stream = stream.id();
        blocks_.emplace(reinterpret_cast<uintptr_t>(ptr), block);
        stats_[static_cast<size_t>(d)].reserved_bytes[kAggregate].increase(size);
        stats_[static_cast<size_t>(d)].segment[kAggregate].increase(1);
      }
      block->allocated = true;
      block->uses.clear();
      auto& stats = stats_[static_cast<size_t>(d)];
      stats.allocated_bytes[kAggregate].increase(block->size);
      stats.allocation[kAggregate].increase(1);
      stats.active[kAggregate].increase(1);
      stats.active_bytes[kAggregate].increase(block->size);
      stats.requested_bytes[kAggregate].increase(n);
      block_requested_[block] = n;
    }
    c10::DataPtr data_ptr(block->ptr, block, &free_block, device);
    if (reused) {
      // If strict mode throws here, data_ptr gives the block back to its pool.
      report_reuse(*block, t, stream);
    }
    return data_ptr;
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;  // the deleter needs the block, not the pointer
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool initialized() override { return State::get().num_devices() > 0; }

  // As CUDA's: the cached blocks go back to the system. cudaFree synchronizes the device, so the
  // host first waits for every stream (the blocks held back for record_stream() uses are then
  // free too); the blocks' history is forgotten before their memory is given back, since the
  // system may hand the same addresses out again, to anyone.
  void emptyCache(c10::MempoolId_t) override {
    if (State::get().num_devices() == 0) {
      return;
    }
    synchronize(-1);
    std::vector<Block*> released;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (int d = 0; d < State::get().num_devices(); ++d) {
        process_pending_locked(static_cast<c10::DeviceIndex>(d));
        ++stats_[static_cast<size_t>(d)].num_sync_all_streams;  // (as CUDA counts it)
      }
      for (auto& [key, by_size] : pools_) {
        for (auto& [size, blocks] : by_size) {
          for (Block* block : blocks) {
            auto& stats = stats_[static_cast<size_t>(block->device)];
            stats.reserved_bytes[kAggregate].decrease(block->size);
            stats.segment[kAggregate].decrease(1);
            blocks_.erase(reinterpret_cast<uintptr_t>(block->ptr));
            released.push_back(block);
          }
        }
      }
      pools_.clear();
    }
    for (Block* block : released) {
      const auto begin = reinterpret_cast<uintptr_t>(block->ptr);
      State::get().checker().forget(begin, begin + block->size);
      std::free(block->ptr);
      delete block;
    }
  }

  void recordStream(const c10::DataPtr& data_ptr, c10::Stream stream) override {
    if (data_ptr.get_deleter() != &free_block || data_ptr.get_context() == nullptr) {
      return;  // not a block of this allocator (e.g. an empty tensor)
    }
    auto* block = static_cast<Block*>(data_ptr.get_context());
    const Timeline t = State::get().timeline(stream);
    std::lock_guard<std::mutex> lock(mutex_);
    if (stream.device_index() == block->device && stream.id() == block->stream) {
      return;  // its own stream: ordered anyway
    }
    if (std::find(block->uses.begin(), block->uses.end(), t) == block->uses.end()) {
      block->uses.push_back(t);
    }
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex d) override {
    d = check_device(d);
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_[static_cast<size_t>(d)];
  }

  void resetAccumulatedStats(c10::DeviceIndex d) override {
    for_each_stat(d, [](auto& stat) { stat.reset_accumulated(); });
  }

  void resetPeakStats(c10::DeviceIndex d) override {
    for_each_stat(d, [](auto& stat) { stat.reset_peak(); });
  }

  // Calls fn on every statistic of device d (under the allocator's lock).
  template <typename Fn>
  void for_each_stat(c10::DeviceIndex d, Fn fn) {
    d = check_device(d);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& s = stats_[static_cast<size_t>(d)];
    for (auto* array : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes, &s.reserved_bytes,
                        &s.active_bytes, &s.requested_bytes}) {
      for (auto& stat : *array) {
        fn(stat);
      }
    }
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex d) override {
    d = check_device(d);
    constexpr size_t kTotal = size_t{64} << 30;  // a nominal 64 GiB device
    std::lock_guard<std::mutex> lock(mutex_);
    const auto used =
        static_cast<size_t>(stats_[static_cast<size_t>(d)].reserved_bytes[kAggregate].current);
    return {used < kTotal ? kTotal - used : 0, kTotal};
  }

  void free(Block* block) {
    // Runs in a deleter: never throws. The checker's snapshot() only throws for unknown
    // timelines, which the uses cannot be.
    StorageNames::get().forget(block->ptr);
    std::lock_guard<std::mutex> lock(mutex_);
    block->allocated = false;
    auto& stats = stats_[static_cast<size_t>(block->device)];
    stats.allocated_bytes[kAggregate].decrease(block->size);
    stats.allocation[kAggregate].decrease(1);
    stats.active[kAggregate].decrease(1);
    stats.active_bytes[kAggregate].decrease(block->size);
    auto req = block_requested_.find(block);
    if (req != block_requested_.end()) {
      stats.requested_bytes[kAggregate].decrease(req->second);
      block_requested_.erase(req);
    }
    if (block->uses.empty()) {
      pools_[{block->device, block->stream}][block->size].push_back(block);
      return;
    }
    // The "events" recorded on the uses' streams: their clocks now.
    Pending pending{block, {}, {}};
    try {
      for (Timeline t : block->uses) {
        pending.marks.emplace_back(t, stream_position(t));
        const VectorClock clock = State::get().checker().snapshot(t);
        if (pending.completed.size() < clock.size()) {
          pending.completed.resize(clock.size(), 0);
        }
        for (size_t i = 0; i < clock.size(); ++i) {
          pending.completed[i] = std::max(pending.completed[i], clock[i]);
        }
      }
    } catch (...) {
    }
    block->uses.clear();
    pending_.push_back(std::move(pending));
  }

  // fork(): held by the forking thread around fork() (fork.h).
  void lock_for_fork() { mutex_.lock(); }
  void unlock_after_fork() { mutex_.unlock(); }

  std::optional<c10::DeviceIndex> device_of(const void* ptr) {
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.upper_bound(p);
    if (it == blocks_.begin()) {
      return std::nullopt;
    }
    --it;
    if (p >= it->first + it->second->size) {
      return std::nullopt;
    }
    return it->second->device;
  }

 private:
  // "process_events": the events recorded on the uses' streams report completion, and the blocks
  // go back to their pools. Only the allocator learns of that completion, and only for the
  // block: the uses of the block ordered before those events are released (the block's reuse
  // does not race with them), while no stream, nor the host, is ordered after them (a program
  // that relied on it would race on a GPU, where the query may come back "not ready").
  void process_pending_locked(c10::DeviceIndex d) {
    if (pending_.empty()) {
      return;
    }
    auto& checker = State::get().checker();
    for (auto it = pending_.begin(); it != pending_.end();) {
      const bool complete = std::all_of(it->marks.begin(), it->marks.end(), [](const auto& m) {
        return stream_reached(m.first, m.second);
      });
      if (it->block->device != d || !complete) {
        ++it;
        continue;
      }
      const auto begin = reinterpret_cast<uintptr_t>(it->block->ptr);
      checker.release(begin, begin + it->block->size, it->completed);
      pools_[{d, it->block->stream}][it->block->size].push_back(it->block);
      it = pending_.erase(it);
    }
  }

  void report_reuse(const Block& block, Timeline t, const c10::Stream& stream) {
    Access access;
    access.begin = reinterpret_cast<uintptr_t>(block.ptr);
    access.end = access.begin + block.size;
    access.write = true;
    const std::string& label = State::get().label(stream);
    access.memory = describe_storage(block.device, block.ptr, block.size) +
                    ", a cached block reused on " + label;
    if (tls_reuse_sink != nullptr) {
      tls_reuse_sink->push_back(std::move(access));
      return;
    }
    record(t, "allocation (reuses a block freed on " + label + ")", {std::move(access)});
  }

  std::mutex mutex_;
  // (device, stream) -> block size -> free blocks of that size, most recently freed last
  std::map<std::pair<c10::DeviceIndex, c10::StreamId>, std::map<size_t, std::vector<Block*>>>
      pools_;
  std::vector<Pending> pending_;
  std::map<uintptr_t, Block*> blocks_;  // every block ever made, by address
  std::map<const Block*, size_t> block_requested_;
  std::array<c10::CachingDeviceAllocator::DeviceStats, kMaxDevices> stats_;
};

SimAllocator& the_allocator() {
  static SimAllocator* a = new SimAllocator();  // leaked: deleters may run at exit
  return *a;
}

void free_block(void* ctx) { the_allocator().free(static_cast<Block*>(ctx)); }

}  // namespace

c10::DeviceAllocator* device_allocator() { return &the_allocator(); }

void record_stream(const c10::DataPtr& data_ptr, const c10::Stream& stream) {
  the_allocator().recordStream(data_ptr, stream);
}

bool is_block(const c10::DataPtr& data_ptr) {
  return data_ptr.get_deleter() == &free_block && data_ptr.get_context() != nullptr;
}

std::optional<c10::DeviceIndex> device_of(const void* ptr) {
  return the_allocator().device_of(ptr);
}

void lock_allocators_for_fork() {
  the_allocator().lock_for_fork();
  lock_pinned_for_fork();
}

void unlock_allocators_after_fork() {
  unlock_pinned_after_fork();
  the_allocator().unlock_after_fork();
}

DeferReuseReports::DeferReuseReports(std::vector<Access>* sink) : previous_(tls_reuse_sink) {
  tls_reuse_sink = sink;
}

DeferReuseReports::~DeferReuseReports() { tls_reuse_sink = previous_; }

c10::DataPtr retag(c10::DataPtr&& data_ptr, c10::Device device) {
  void* data = data_ptr.get();
  auto ctx = data_ptr.move_context();
  c10::DeleterFnPtr deleter = ctx.get_deleter();
  return c10::DataPtr(data, ctx.release(), deleter, device);
}

}  // namespace sim
}  // namespace torch_pipeline
