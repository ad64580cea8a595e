// A thread of its own that runs tasks in order, like the operations of a
// CUDA stream: the CPU twin's copy queues and completion threads
// (cpu_runtime.h) and the async issuers (issuer.h).

#ifndef FICCO_XLA_FFI_TASK_THREAD_H_
#define FICCO_XLA_FFI_TASK_THREAD_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace ficco {

// Never destroyed: its detached thread blocks on the condition variable
// forever, which must never be destroyed under it at interpreter exit (the
// owners leak them). With a nonzero `spin`, the thread yields for that long
// after each task before it sleeps: a sleeping thread takes tens of
// microseconds to wake, which matters where tasks come every few tens.
class TaskThread {
 public:
  explicit TaskThread(std::chrono::microseconds spin = {}) : spin_(spin) {
    std::thread([this] { Run(); }).detach();
  }

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
      const auto spin_until = std::chrono::steady_clock::now() + spin_;
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
      // Destroying the task may drop the last reference to an invocation,
      // which returns its events to the pools: do it outside the lock.
      task();
      task = nullptr;
    }
  }

  const std::chrono::microseconds spin_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::atomic<int64_t> pending_{0};
};

}  // namespace ficco

#endif  // FICCO_XLA_FFI_TASK_THREAD_H_
