// tp.track (see TrackScope in tracking.h): accesses of kernels the dispatcher never sees, on the
// current streams of the tensors' devices, from the constructor to the destructor. Touches only
// the scope's members; acts through the pins, host-watch and launch rooms.
#include "../warn.h"
#include "host_watch.h"
#include "launch.h"
#include "pins.h"
#include "state.h"

namespace torch_pipeline {
namespace tracking {

TrackScope::TrackScope(const std::vector<at::Tensor>& reads, const std::vector<at::Tensor>& writes) {
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
  device_launch(run, accesses, /*async=*/false, launched_, period_);
  // The scope's keep-alives are its own (ops inside the block must not take them).
  keep_alive_ = std::move(run.keep_alive);
  run.keep_alive.clear();
}

TrackScope::~TrackScope() {
  using namespace detail;
  if (launched_.empty()) {
    return;
  }
  ThreadRun& run = thread_run();
  run.keep_alive = std::move(keep_alive_);
  try {
    finish(run, launched_, period_, nullptr, false);
  } catch (const std::exception& e) {
    warn_once("tracking failed at the end of tp.track",
              std::string("automatic synchronization failed at the end of tp.track (") +
                  e.what() + "); the accesses may race.");
  }
}

}  // namespace tracking
}  // namespace torch_pipeline
