// fork() and the sim device. In a child forked while other threads use the device, only the
// forking thread exists: a lock another thread held at fork() would stay locked forever, and the
// state it guards could be half-changed. So enable() registers fork handlers that take every lock
// of the device before fork() and release them after it, in the parent and in the child. The
// prepare handler takes them in this order, which is the order in which a thread may nest them
// (a thread holding one may take later ones, never earlier ones):
//   enable()'s lock (enable.cpp), the device allocator's (allocator.cpp), the pinned allocator's
//   (pinned.cpp), the pending host accesses' (host.cpp), the streams' (State), the events'
//   (guard.cpp), the race checker's (RaceChecker), the stream queues' registry and asynchronous
//   error (executor.cpp), the latency model's (latency.cpp). In the child, the parent's stream
//   queues are dropped (executor.h).
// The per-operator facts (csrc/runtime/op_facts.cpp) register their own handlers: their lock is
// taken with no other held. Thread-local state is the forking thread's own and stays valid.
#pragma once

namespace torch_pipeline {
namespace sim {

// Registers the handlers, once (enable.cpp; called by enable() under its lock).
void register_fork_handlers();

void lock_allocators_for_fork();  // allocator.cpp (the device's, then the pinned one's)
void unlock_allocators_after_fork();
void lock_pinned_for_fork();  // pinned.cpp
void unlock_pinned_after_fork();
void lock_host_for_fork();  // host.cpp
void unlock_host_after_fork();
void lock_events_for_fork();  // guard.cpp
void unlock_events_after_fork();
void lock_latency_for_fork();  // latency.cpp
void unlock_latency_after_fork();

}  // namespace sim
}  // namespace torch_pipeline
