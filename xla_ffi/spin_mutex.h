// A mutex for the protocol's short critical sections that never block
// inside (the registry's maps, the event pools), which every device's XLA
// thread, issuer and sync takes several times per op.

#ifndef FICCO_XLA_FFI_SPIN_MUTEX_H_
#define FICCO_XLA_FFI_SPIN_MUTEX_H_

#include <atomic>
#include <thread>

namespace ficco {

// Spins, yielding after a few turns, instead of parking in a futex wait: a
// contended std::mutex puts the loser to sleep, and waking it takes tens of
// microseconds, the size of a short op's whole host budget per start. The
// sections it guards are a few map operations long, so a waiter spins for
// about that long. Satisfies Lockable (std::lock_guard, std::unique_lock).
class SpinMutex {
 public:
  void lock() {
    int turns = 0;
    while (locked_.exchange(true, std::memory_order_acquire)) {
      // Wait on a plain load, so waiters do not bounce the line with writes.
      while (locked_.load(std::memory_order_relaxed)) {
        if (++turns > 64) std::this_thread::yield();
      }
    }
  }
  bool try_lock() {
    return !locked_.load(std::memory_order_relaxed) &&
           !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

}  // namespace ficco

#endif  // FICCO_XLA_FFI_SPIN_MUTEX_H_
