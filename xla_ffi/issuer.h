// Issue modes of the peer-copy protocol (PROTOCOL.md, "Three ways to
// issue"), and the per-device issuer threads of the asynchronous one.

#ifndef FICCO_XLA_FFI_ISSUER_H_
#define FICCO_XLA_FFI_ISSUER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace ficco {

// Who enqueues an invocation's copies (values of the C API, ficco_ffi.h).
enum IssueMode : int {
  // The last rank to arrive issues every rank's copies; start never waits.
  kIssueLast = 0,
  // Each rank waits in start for its peers, then issues what it receives.
  kIssueParallel = 1,
  // start only publishes; a thread of ficco's own per device waits for the
  // peers and issues what the device receives, off XLA's thread.
  kIssueAsync = 2,
};

inline const char* IssueModeName(int mode) {
  switch (mode) {
    case kIssueLast: return "last";
    case kIssueParallel: return "parallel";
    case kIssueAsync: return "async";
  }
  return "?";
}

// The mode named by environment variable `var` (last, parallel, async), or
// `fallback` if it is unset or names none.
inline int IssueModeFromEnv(const char* var, int fallback) {
  const char* v = std::getenv(var);
  if (v == nullptr) return fallback;
  const std::string s(v);
  for (int mode : {kIssueLast, kIssueParallel, kIssueAsync}) {
    if (s == IssueModeName(mode)) return mode;
  }
  return fallback;
}

// One device's issuer: tasks run in order on a thread of their own. It
// spins (yielding) for a while before it sleeps: back-to-back ops hand it a
// task every few tens of microseconds, and a sleeping thread takes tens of
// microseconds to wake. Never destroyed (see IssuerOf).
class Issuer {
 public:
  Issuer() { std::thread([this] { Run(); }).detach(); }

  void Push(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
      pending_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_one();
  }

 private:
  [[noreturn]] void Run() {
    for (;;) {
      const auto spin_until =
          std::chrono::steady_clock::now() + std::chrono::microseconds(500);
      while (pending_.load(std::memory_order_acquire) == 0 &&
             std::chrono::steady_clock::now() < spin_until) {
        std::this_thread::yield();
      }
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.pop_front();
        pending_.fetch_sub(1, std::memory_order_relaxed);
      }
      // Dropping the task may free an invocation: outside the lock.
      task();
      task = nullptr;
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::atomic<int64_t> pending_{0};
};

// Issuers are created on first use and leaked: their detached threads must
// never see their state destroyed at interpreter exit. One per (platform
// tag, device), so the CPU twin and CUDA never share a thread.
inline Issuer& IssuerOf(int platform, int32_t device) {
  static std::mutex* mu = new std::mutex();
  static auto* issuers = new std::map<std::pair<int, int32_t>, Issuer*>();
  std::lock_guard<std::mutex> lock(*mu);
  Issuer*& q = (*issuers)[{platform, device}];
  if (q == nullptr) q = new Issuer();
  return *q;
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_ISSUER_H_
