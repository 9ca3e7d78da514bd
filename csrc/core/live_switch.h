// Plain C++17 (no torch includes). Holds the live/idle state machine of the automatic-
// synchronization tracker: which state was reached last, whether a thread is switching now, and
// the requests made since. Touches only its members and the actions it is given; the runtime
// (csrc/runtime/tracking/life.cpp) owns one, with go_live / go_idle that install / remove the
// RecordFunction callback and wait for devices.
//
// No lock is held while an action runs (going idle waits for devices and removes a callback;
// callers may hold the GIL). One thread switches at a time: a request made while another thread
// switches is left to that thread, which checks wanted() again after every action and stops only
// when the state matches it. So a pipeline created while the last one's go_idle waits ends live.
// A caller that needs the state right when it returns (settle) waits, through the wait function
// it passes (the Python layer's lets go of the GIL), until a check made after its request.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>

namespace torch_pipeline {
namespace core {

class LiveSwitch {
 public:
  struct Actions {
    std::function<bool()> wanted;   // whether the state should be live now (lock-free reads)
    std::function<void()> go_live;  // idle -> live
    // live -> idle; false: not now (the state stays live and this switch stops: whatever refused
    // must update() again once it no longer does)
    std::function<bool()> go_idle;
  };
  // Blocks the caller until step(timeout) returns true.
  using Step = std::function<bool(std::chrono::milliseconds)>;
  using Wait = std::function<void(const Step&)>;

  explicit LiveSwitch(Actions actions);
  ~LiveSwitch();
  LiveSwitch(const LiveSwitch&) = delete;
  LiveSwitch& operator=(const LiveSwitch&) = delete;

  // Brings the state in line with wanted(). While another thread switches, returns at once (that
  // thread sees this request) unless `settle`: then waits with `wait` (plain polling if empty)
  // until the state has been checked against wanted() after this call. An action that throws
  // leaves the state as it was and the exception propagates (waiters are released).
  void update(bool settle, const Wait& wait = Wait());

  // The state the last action reached.
  bool live() const;
  // Whether a thread is switching now.
  bool switching() const;

  // In a forked child (only the forking thread exists; a parent's thread may have held the
  // mutex): fresh mutex and condition variable (the old ones are leaked), idle, nobody switching.
  void reset_after_fork();

 private:
  struct Sync {
    std::mutex mutex;
    std::condition_variable cv;
  };
  Actions actions_;
  Sync* sync_;              // replaced after fork
  bool live_ = false;       // guarded by sync_->mutex
  bool busy_ = false;       // a thread is switching
  uint64_t requested_ = 0;  // update() calls so far
  uint64_t checked_ = 0;    // the requests a finished check has seen
};

}  // namespace core
}  // namespace torch_pipeline
