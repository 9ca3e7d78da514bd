// The tracker's live/idle state machine (core/live_switch.h): no lock held across the actions,
// requests made during a switch are honoured, and it ends live iff wanted.
#include "core/live_switch.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

using torch_pipeline::core::LiveSwitch;

namespace {

struct Model {
  std::atomic<int> pipelines{0};
  std::atomic<bool> live{false};
  std::atomic<int> idle_calls{0}, live_calls{0};
  std::atomic<bool> in_go_idle{false};
  std::chrono::milliseconds idle_delay{0};
  std::mutex* gil = nullptr;  // when set, go_idle's device wait needs it (as a task does the GIL)

  LiveSwitch::Actions actions() {
    return LiveSwitch::Actions{[this] { return pipelines.load() > 0; },
                               [this] {
                                 EXPECT_FALSE(live.exchange(true)) << "went live twice";
                                 ++live_calls;
                               },
                               [this] {
                                 EXPECT_TRUE(live.exchange(false)) << "went idle twice";
                                 in_go_idle = true;
                                 std::this_thread::sleep_for(idle_delay);
                                 if (gil != nullptr) {
                                   std::lock_guard<std::mutex> l(*gil);
                                 }
                                 in_go_idle = false;
                                 ++idle_calls;
                                 return true;
                               }};
  }
};

}  // namespace

TEST(LiveSwitch, FollowsWhatIsWanted) {
  Model m;
  LiveSwitch sw(m.actions());
  sw.update(true);
  EXPECT_FALSE(sw.live());
  m.pipelines = 1;
  sw.update(true);
  EXPECT_TRUE(sw.live());
  EXPECT_TRUE(m.live);
  m.pipelines = 0;
  sw.update(false);
  EXPECT_FALSE(sw.live());
  EXPECT_EQ(m.live_calls, 1);
  EXPECT_EQ(m.idle_calls, 1);
}

// A pipeline created while the last one's go_idle is waiting: the creator (holding the "GIL",
// which the device wait needs) lets go of it while it waits, and the state ends live. With a lock
// held across go_idle the creator would block on it with the GIL held: a deadlock.
TEST(LiveSwitch, CreationDuringGoIdleEndsLiveWithoutDeadlock) {
  Model m;
  std::mutex gil;
  m.gil = &gil;
  m.idle_delay = std::chrono::milliseconds(100);
  LiveSwitch sw(m.actions());
  m.pipelines = 1;
  sw.update(true);
  std::thread idler([&] {
    m.pipelines = 0;
    sw.update(false);  // a task's end on a worker thread: no GIL
  });
  while (!m.in_go_idle) {
    std::this_thread::yield();
  }
  auto created = std::async(std::launch::async, [&] {
    std::unique_lock<std::mutex> held(gil);
    m.pipelines = 1;
    sw.update(true, [&](const LiveSwitch::Step& step) {
      held.unlock();  // the Python layer's wait releases the GIL
      while (!step(std::chrono::milliseconds(5))) {
      }
      held.lock();
    });
    return sw.live();
  });
  ASSERT_EQ(created.wait_for(std::chrono::seconds(20)), std::future_status::ready) << "deadlock";
  EXPECT_TRUE(created.get());
  idler.join();
  EXPECT_TRUE(m.live);
  EXPECT_TRUE(sw.live());
}

TEST(LiveSwitch, ConcurrentCreationAndDestructionEndsLiveIffWanted) {
  for (int final_count : {0, 1}) {
    Model m;
    m.idle_delay = std::chrono::milliseconds(1);
    LiveSwitch sw(m.actions());
    std::vector<std::thread> threads;
    for (int t = 0; t < 6; ++t) {
      threads.emplace_back([&] {
        for (int i = 0; i < 200; ++i) {
          if (m.pipelines.fetch_add(1) == 0) sw.update(true);
          if (m.pipelines.fetch_sub(1) == 1) sw.update(false);
        }
      });
    }
    for (auto& t : threads) t.join();
    if (final_count == 1 && m.pipelines.fetch_add(1) == 0) {
      sw.update(true);
    }
    sw.update(true);  // (settles)
    EXPECT_EQ(sw.live(), final_count == 1);
    EXPECT_EQ(m.live.load(), final_count == 1);
    EXPECT_FALSE(sw.switching());
  }
}

TEST(LiveSwitch, AFailingActionReleasesWaitersAndKeepsTheState) {
  bool fail = true;
  LiveSwitch sw(LiveSwitch::Actions{[] { return true; },
                                    [&] {
                                      if (fail) throw std::runtime_error("no");
                                    },
                                    [] { return true; }});
  EXPECT_THROW(sw.update(true), std::runtime_error);
  EXPECT_FALSE(sw.live());
  EXPECT_FALSE(sw.switching());
  fail = false;
  sw.update(true);
  EXPECT_TRUE(sw.live());
}

// A go_idle that refuses (a graph capture is about to begin: the runtime's go_idle may not touch
// the devices then) leaves the state live and ends the switch (no spinning while the refusal
// lasts, whatever wanted() says); a later update goes idle.
TEST(LiveSwitch, ARefusedGoIdleStaysLive) {
  std::atomic<bool> capturing{false};
  std::atomic<bool> pipelines{true};
  int refused = 0, idled = 0;
  LiveSwitch sw(
      LiveSwitch::Actions{[&] { return pipelines.load() || capturing.load(); }, [] {},
                          [&] {
                            if (refused == 0) {
                              capturing = true;  // (a capture begins between wanted() and go_idle)
                            }
                            if (capturing) {
                              ++refused;
                              return false;
                            }
                            ++idled;
                            return true;
                          }});
  sw.update(true);
  EXPECT_TRUE(sw.live());
  pipelines = false;
  sw.update(true);
  EXPECT_TRUE(sw.live());  // refused once, and the switch stopped
  EXPECT_EQ(refused, 1);
  EXPECT_EQ(idled, 0);
  capturing = true;
  std::atomic<bool> lying{true};  // (even a wanted() that says idle throughout does not spin)
  LiveSwitch stubborn(
      LiveSwitch::Actions{[&] { return !lying.load(); }, [] {}, [&] { return !lying.load(); }});
  lying = false;
  stubborn.update(true);
  lying = true;
  stubborn.update(true);
  EXPECT_TRUE(stubborn.live());
  EXPECT_FALSE(stubborn.switching());
  capturing = false;  // the capture ended
  sw.update(true);
  EXPECT_FALSE(sw.live());
  EXPECT_EQ(refused, 1);
  EXPECT_EQ(idled, 1);
}

// In a forked child: idle, nobody switching, and it switches again (the child exits with _exit,
// so the old lock it leaks on purpose is not reported).
TEST(LiveSwitch, ResetAfterForkForgetsEverything) {
  Model m;
  LiveSwitch sw(m.actions());
  m.pipelines = 1;
  sw.update(true);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    sw.reset_after_fork();
    bool ok = !sw.live() && !sw.switching();
    m.live = false;  // (the child's own actions start idle)
    sw.update(true);
    ok = ok && sw.live() && m.live;
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_TRUE(sw.live());  // (the parent's is untouched)
}
