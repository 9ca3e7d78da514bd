// Communication streams (issue 5): one per (worker thread, device), shared by every pipeline bound
// to that worker thread, created on first use, exclusive where the backend allows it (never one
// of the compute streams). Collectives issued from one thread go to one stream, in program order.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <string>
#include <vector>

namespace torch_pipeline {

// The communication stream of worker thread `worker_id` on `device` (checked: an existing
// accelerator device; ValueError for a worker id past the cap).
c10::Stream comm_stream(int worker_id, const c10::Device& device);

// The worker thread whose communication streams the calling thread uses: its own on a worker
// thread, otherwise that of its current pipeline (worker thread 0 for the default pipeline).
int collective_worker();

// RAII (tp.collective()): the current streams of the devices the current pipeline works on
// become the communication streams of collective_worker(); the destructor restores them. While
// automatic synchronization is idle (no non-default pipeline alive), the comm streams wait for the
// streams they replace on entry, and those wait for them on exit.
class CollectiveGuard {
 public:
  CollectiveGuard();
  ~CollectiveGuard();
  CollectiveGuard(const CollectiveGuard&) = delete;
  CollectiveGuard& operator=(const CollectiveGuard&) = delete;

 private:
  bool tracked_;
  std::vector<c10::Stream> saved_;
};

// Debug mode (tp.distributed.set_debug): collectives issued into one process group from more than
// one thread can be ordered differently on different ranks and deadlock. While on, every c10d op
// is observed and a process group used from a second thread is reported (a warning, once, and the
// list below). Off by default (it observes every op); TORCH_PIPELINE_DEBUG_COLLECTIVES=1 turns it
// on at import.
void set_collective_debug(bool on);
bool collective_debug();
std::vector<std::string> collective_hazards();
void clear_collective_hazards();

}  // namespace torch_pipeline
