// tp.track (see TrackScope in tracking.h): accesses of kernels the dispatcher never sees, on the
// current streams of the tensors' devices, from the constructor to the destructor; and the scope
// launch and end it shares with compiled regions (scope.h). Touches only the scope's members; acts
// through the pins, host-watch and launch modules.
#include "../warn.h"
#include "host_watch.h"
#include "launch.h"
#include "pins.h"
#include "scope.h"
#include "state.h"

namespace torch_pipeline {
namespace tracking {

namespace detail {

void open_scope(const std::vector<Access>& accesses, std::vector<Launched>& launched,
                uint64_t& period, std::vector<PendingKeepAlive>& keep_alive) {
  wait_for_pins(accesses);
  std::vector<Access> cpu;
  for (const Access& a : accesses) {
    if (a.tensor->device().is_cpu()) {
      cpu.push_back(a);
    }
  }
  ThreadRun& run = thread_run();
  if (!cpu.empty() && (watching_host() || g_pins.load() > 0)) {
    host_access(cpu, run.reads, run.writes);
  }
  if (cpu.size() == accesses.size()) {
    return;
  }
  device_launch(run, accesses, /*async=*/false, launched, period);
  keep_alive = std::move(run.keep_alive);
  run.keep_alive.clear();
}

void close_scope(std::vector<Launched>& launched, uint64_t period,
                 std::vector<PendingKeepAlive>& keep_alive, const std::vector<at::Tensor>* fresh,
                 const char* what, const std::vector<at::Tensor>* moved) {
  ThreadRun& run = thread_run();
  run.keep_alive = std::move(keep_alive);
  try {
    finish(run, launched, period, fresh, false, moved);
  } catch (const std::exception& e) {
    warn_once(std::string("tracking failed at the end of ") + what,
              std::string("automatic synchronization failed at the end of ") + what + " (" +
                  e.what() + "); the accesses may race.");
  }
  launched.clear();
}

}  // namespace detail

TrackScope::TrackScope(const std::vector<at::Tensor>& reads,
                       const std::vector<at::Tensor>& writes) {
  using namespace detail;
  if (!live()) {
    return;
  }
  std::vector<Access> accesses;
  for (const at::Tensor& t : reads) {
    if (has_data(t)) accesses.push_back(Access{&t, false});
  }
  for (const at::Tensor& t : writes) {
    if (has_data(t)) accesses.push_back(Access{&t, true});
  }
  open_scope(accesses, launched_, period_, keep_alive_);
}

TrackScope::~TrackScope() {
  if (!launched_.empty()) {
    detail::close_scope(launched_, period_, keep_alive_, nullptr, "tp.track");
  }
}

}  // namespace tracking
}  // namespace torch_pipeline
