// The live/idle state machine (see live_switch.h). Touches only the LiveSwitch's members; the
// actions run with no lock held.
#include "live_switch.h"

#include <exception>

namespace torch_pipeline {
namespace core {

LiveSwitch::LiveSwitch(Actions actions) : actions_(std::move(actions)), sync_(new Sync()) {}

LiveSwitch::~LiveSwitch() { delete sync_; }

void LiveSwitch::update(bool settle, const Wait& wait) {
  std::unique_lock<std::mutex> lock(sync_->mutex);
  const uint64_t mine = ++requested_;
  if (busy_) {
    if (!settle) {
      return;  // the switching thread checks again before it stops
    }
    Sync* sync = sync_;
    lock.unlock();
    const Step step = [this, sync, mine](std::chrono::milliseconds timeout) {
      std::unique_lock<std::mutex> l(sync->mutex);
      return sync->cv.wait_for(l, timeout, [&] { return checked_ >= mine; });
    };
    if (wait) {
      wait(step);
    } else {
      while (!step(std::chrono::milliseconds(50))) {
      }
    }
    return;
  }
  busy_ = true;
  for (;;) {
    const uint64_t seen = requested_;
    const bool want = actions_.wanted();
    if (want == live_) {
      checked_ = seen;
      busy_ = false;
      lock.unlock();
      sync_->cv.notify_all();
      return;
    }
    lock.unlock();
    bool reached = true;
    try {
      if (want) {
        actions_.go_live();
      } else {
        reached = actions_.go_idle();
      }
    } catch (...) {
      lock.lock();
      checked_ = requested_;  // (waiters return; the state is what it was)
      busy_ = false;
      lock.unlock();
      sync_->cv.notify_all();
      throw;
    }
    lock.lock();
    if (!reached) {
      checked_ = seen;  // (go_idle refused: live until the refuser's next update)
      busy_ = false;
      lock.unlock();
      sync_->cv.notify_all();
      return;
    }
    live_ = want;
  }
}

bool LiveSwitch::live() const {
  std::lock_guard<std::mutex> lock(sync_->mutex);
  return live_;
}

bool LiveSwitch::switching() const {
  std::lock_guard<std::mutex> lock(sync_->mutex);
  return busy_;
}

void LiveSwitch::reset_after_fork() {
  sync_ = new Sync();  // the old one may be locked by a thread that no longer exists: leaked
  live_ = false;
  busy_ = false;
  requested_ = 0;
  checked_ = 0;
}

}  // namespace core
}  // namespace torch_pipeline
