// The CPU twin's stand-ins for a GPU's runtime, shared by both CPU
// transports (cpu_peer_copy.cc, cpu_window.cc): events (flags with condition
// variables and callbacks), copy queues (a thread each, like a stream) and a
// watchdog that fires callbacks at deadlines.

#ifndef FICCO_XLA_FFI_CPU_RUNTIME_H_
#define FICCO_XLA_FFI_CPU_RUNTIME_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "event_pool.h"
#include "peer_copy_registry.h"  // Clock
#include "task_thread.h"

namespace ficco {

class CpuEvent {
 public:
  enum State { kPending, kOk, kFailed };
  using Callback = std::function<void(State)>;

  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = kPending;
    callbacks_.clear();
  }
  void Set(State s) {
    std::vector<Callback> callbacks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      state_ = s;
      callbacks.swap(callbacks_);
    }
    cv_.notify_all();
    for (auto& callback : callbacks) callback(s);
  }
  // Calls `callback` once the event is set (now, if it is).
  void OnSet(Callback callback) {
    State s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_ == kPending) {
        callbacks_.push_back(std::move(callback));
        return;
      }
      s = state_;
    }
    callback(s);
  }
  // The state now (kPending if not set yet), without waiting.
  State Peek() {
    std::lock_guard<std::mutex> lock(mu_);
    return state_;
  }
  // The state once set, or kPending if `deadline` passed first.
  State WaitUntil(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return state_ != kPending; });
    return state_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  State state_ = kPending;
  std::vector<Callback> callbacks_;
};

// One copy queue: a TaskThread, like the operations of a CUDA stream.
using CopyQueue = TaskThread;

// Queues are created on first use and leaked: their detached threads block
// on their condition variable forever, which must never be destroyed under
// them at interpreter exit. stream == -1 is the device's completion thread.
inline CopyQueue& Queue(int32_t device, int64_t stream) {
  static std::mutex* mu = new std::mutex();
  static auto* queues = new std::map<std::pair<int32_t, int64_t>, CopyQueue*>();
  std::lock_guard<std::mutex> lock(*mu);
  CopyQueue*& q = (*queues)[{device, stream}];
  if (q == nullptr) q = new CopyQueue();
  return *q;
}

// XLA continues a device's execution on the thread that completes its
// future; doing that on a copy queue would stall the device's incoming
// copies (which peers forwarding from it wait for), so futures complete on a
// thread of their own per device.
inline CopyQueue& Completer(int32_t device) { return Queue(device, -1); }

// Fires callbacks at deadlines: the bound of every asynchronous wait. A
// wait that completes cancels its timer, so only waits in flight hold state
// here; a timer kept to its deadline would hold its wait's state for
// `timeout_s` after every call.
class Watchdog {
 public:
  struct Timer {
    Clock::time_point when;
    uint64_t id = 0;  // 0: no timer
  };
  static Watchdog& Get() {
    static Watchdog* watchdog = new Watchdog();  // Leaked, like the queues.
    return *watchdog;
  }
  Timer At(Clock::time_point when, std::function<void()> callback) {
    Timer t{when, 0};
    {
      std::lock_guard<std::mutex> lock(mu_);
      t.id = ++next_id_;
      timers_.emplace(std::make_pair(when, t.id), std::move(callback));
    }
    cv_.notify_one();
    return t;
  }
  // Drops a timer that has not fired; a no-op once it has (or for {}).
  void Cancel(const Timer& t) {
    if (t.id == 0) return;
    std::function<void()> dropped;  // Destroyed outside the lock.
    std::lock_guard<std::mutex> lock(mu_);
    auto it = timers_.find({t.when, t.id});
    if (it == timers_.end()) return;
    dropped = std::move(it->second);
    timers_.erase(it);
  }
  size_t Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return timers_.size();
  }

 private:
  Watchdog() { std::thread([this] { Run(); }).detach(); }
  [[noreturn]] void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (timers_.empty()) {
        cv_.wait(lock);
      } else if (Clock::now() < timers_.begin()->first.first) {
        cv_.wait_until(lock, timers_.begin()->first.first);
      } else {
        auto callback = std::move(timers_.begin()->second);
        timers_.erase(timers_.begin());
        lock.unlock();
        callback();
        callback = nullptr;
        lock.lock();
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_id_ = 0;
  std::map<std::pair<Clock::time_point, uint64_t>, std::function<void()>>
      timers_;
};

// A pending event from `pools` (both CPU transports keep per-device pools).
inline xla::ffi::ErrorOr<CpuEvent*> AcquireCpuEvent(EventPools<CpuEvent>& pools,
                                                    int32_t device) {
  auto e = pools.Acquire(device, [](int32_t) -> xla::ffi::ErrorOr<CpuEvent*> {
    return new CpuEvent();
  });
  if (e.has_value()) (*e)->Reset();
  return e;
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_CPU_RUNTIME_H_
