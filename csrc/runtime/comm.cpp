#include "comm.h"

#include "../core/worker_pool.h"
#include "context.h"
#include "devices.h"
#include "op_facts.h"
#include "runtime.h"
#include "tracking.h"
#include "warn.h"

#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

namespace torch_pipeline {

c10::Stream comm_stream(int worker_id, const c10::Device& device) {
  return Runtime::get().comm_stream(worker_id, check_stream_device(device));
}

int collective_worker() {
  const int me = core::WorkerThread::current_id();
  return me >= 0 ? me : current_pipeline()->worker_id();
}

CollectiveGuard::CollectiveGuard() : tracked_(tracking::live()) {
  const int worker = collective_worker();
  const PipelinePtr p = current_pipeline();
  const DeviceStreams lane = lane_streams(*p);
  try {
    for (const auto& ds : lane) {
      const c10::Stream s = comm_stream(worker, ds.first);
      const auto* impl = c10::impl::getDeviceGuardImpl(s.device_type());
      if (!tracked_ && s != ds.second) {
        // Nothing orders the collectives automatically: the comm stream waits for the stream it
        // replaces (its inputs were made there), and the destructor makes it wait back.
        c10::Event before(s.device_type());
        before.record(ds.second);
        before.block(s);
      }
      saved_.push_back(impl->exchangeStream(s));
    }
  } catch (...) {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      c10::impl::getDeviceGuardImpl(it->device_type())->exchangeStream(*it);
    }
    throw;
  }
}

CollectiveGuard::~CollectiveGuard() {
  try {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      const auto* impl = c10::impl::getDeviceGuardImpl(it->device_type());
      const c10::Stream comm = impl->exchangeStream(*it);
      if (!tracked_ && comm != *it) {
        c10::Event after(comm.device_type());
        after.record(comm);
        after.block(*it);
      }
    }
  } catch (const std::exception& e) {
    warn(std::string("could not restore the streams after collective(): ") + e.what());
  }
}

namespace {

struct Issuer {
  std::thread::id thread;
  int worker;  // -1: not a worker thread
};

std::mutex g_debug_mutex;
std::optional<at::CallbackHandle> g_debug_callback;
std::map<const void*, Issuer>* g_issuers = new std::map<const void*, Issuer>();
std::vector<std::string>* g_hazards = new std::vector<std::string>();
constexpr size_t kMaxHazards = 100;

std::string describe(const Issuer& i) {
  std::ostringstream os;
  if (i.worker >= 0) {
    os << "worker thread " << i.worker;
  } else {
    os << "thread " << i.thread << " (not a worker thread)";
  }
  return os.str();
}

std::unique_ptr<at::ObserverContext> on_c10d_op(const at::RecordFunction& fn) {
  if (std::strncmp(fn.name(), "c10d::", 6) != 0) {
    return nullptr;
  }
  const void* pg = nullptr;
  for (const c10::IValue& v : fn.inputs()) {
    if ((pg = torchbind_target(v)) != nullptr) {  // the ProcessGroup argument
      break;
    }
  }
  if (pg == nullptr) {
    return nullptr;
  }
  const Issuer me{std::this_thread::get_id(), core::WorkerThread::current_id()};
  std::string message;
  {
    std::lock_guard<std::mutex> lock(g_debug_mutex);
    auto [it, inserted] = g_issuers->emplace(pg, me);
    if (inserted || it->second.thread == me.thread) {
      return nullptr;
    }
    std::ostringstream os;
    os << fn.name() << " on process group " << pg << " from " << describe(me) << ", which "
       << describe(it->second)
       << " also issues collectives on: collectives issued concurrently from two threads into one "
          "process group can run in a different order on different ranks and deadlock; give each "
          "thread its own group (torch_pipeline.distributed.thread_groups)";
    message = os.str();
    if (g_hazards->size() < kMaxHazards) {
      g_hazards->push_back(message);
    }
    it->second = me;  // report each change of thread once
  }
  warn_once("collective hazard", message);
  return nullptr;
}

}  // namespace

void set_collective_debug(bool on) {
  std::lock_guard<std::mutex> lock(g_debug_mutex);
  if (on && !g_debug_callback.has_value()) {
    g_debug_callback = at::addGlobalCallback(at::RecordFunctionCallback(&on_c10d_op)
                                                 .needsInputs(true)
                                                 .scopes({at::RecordScope::FUNCTION}));
  } else if (!on && g_debug_callback.has_value()) {
    at::removeCallback(*g_debug_callback);
    g_debug_callback.reset();
    g_issuers->clear();
  }
}

bool collective_debug() {
  std::lock_guard<std::mutex> lock(g_debug_mutex);
  return g_debug_callback.has_value();
}

std::vector<std::string> collective_hazards() {
  std::lock_guard<std::mutex> lock(g_debug_mutex);
  return *g_hazards;
}

void clear_collective_hazards() {
  std::lock_guard<std::mutex> lock(g_debug_mutex);
  g_hazards->clear();
  g_issuers->clear();
}

}  // namespace torch_pipeline
