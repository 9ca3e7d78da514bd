// The sim device's asynchronous mode (docs/design.md, "Asynchronous mode and the latency model"):
// each stream gets a FIFO queue run by a thread of its own (core::StreamQueue, made lazily); ops
// return once their kernel is queued.
//
// In synchronous mode (the default) every function here runs the work at once on the calling
// thread, positions are 0 and every wait returns at once. Kernels that raise on a stream's thread
// are reported like CUDA's asynchronous errors: the next synchronizing call (stream, event or
// device synchronize, a blocking copy to the host, .item()) raises RuntimeError naming the op.
#pragma once

#include "race_checker.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace torch_pipeline {
namespace sim {

bool asynchronous();
// Switching it off first waits for every queue and stops their threads.
void set_asynchronous(bool on);

// A kernel of `op` on stream `t` touching `bytes` of device memory (for the latency model):
// queued in asynchronous mode, run now otherwise (an exception then propagates).
void launch(Timeline t, const std::string& op, size_t bytes, std::function<void()> work);
// Queues `work` with no modelled time (event markers); returns its position (0 when synchronous).
uint64_t launch_marker(Timeline t, std::function<void()> work);

// What an event recorded on `t` now would wait for: the number of its last queued entry.
uint64_t stream_position(Timeline t);
bool stream_reached(Timeline t, uint64_t position);
// The host waits until `t` reached `position` (default: everything queued so far); then, with
// `report`, raises a pending asynchronous error.
void host_wait(Timeline t, uint64_t position, bool report = true);
void host_wait(Timeline t, bool report = true);
// Stream `waiter` waits, on the device, until `t` reached `position` (an event wait).
void stream_wait(Timeline waiter, Timeline t, uint64_t position);

// Raises (RuntimeError) the first error a queued kernel raised since the last report, if any.
void check_async_error();
// Waits for every queue, stops their threads and stays synchronous (interpreter exit).
void shutdown_executors();
// Number of queue threads running now (for tests).
size_t running_executors();

// fork() (fork.h): the registry's lock is the last of the device's; the child drops the parent's
// queues (their threads do not exist there) and continues their numbering with empty ones.
void lock_executors_for_fork();
void unlock_executors_after_fork();
void reset_executors_in_child();

}  // namespace sim
}  // namespace torch_pipeline
