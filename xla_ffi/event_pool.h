// Per-device pools of events, so that steady-state calls create none: an
// invocation takes its events at start and its last holder gives them back.

#ifndef FICCO_XLA_FFI_EVENT_POOL_H_
#define FICCO_XLA_FFI_EVENT_POOL_H_

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "spin_mutex.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

template <class Event>
class EventPools {
 public:
  // `create(device)` makes a new event when the device's pool is empty.
  template <class Create>
  xla::ffi::ErrorOr<Event*> Acquire(int32_t device, Create create) {
    {
      std::lock_guard<SpinMutex> lock(mu_);
      Pool& pool = pools_[device];
      if (!pool.free.empty()) {
        Event* e = pool.free.back();
        pool.free.pop_back();
        return e;
      }
    }
    xla::ffi::ErrorOr<Event*> e = create(device);
    if (e.has_value()) {
      std::lock_guard<SpinMutex> lock(mu_);
      pools_[device].created++;
    }
    return e;
  }

  void Release(int32_t device, Event* e) {
    std::lock_guard<SpinMutex> lock(mu_);
    pools_[device].free.push_back(e);
  }

  void Counts(int32_t device, int64_t* created, int64_t* pooled) {
    std::lock_guard<SpinMutex> lock(mu_);
    auto it = pools_.find(device);
    *created = it == pools_.end() ? 0 : it->second.created;
    *pooled = it == pools_.end() ? 0 : static_cast<int64_t>(it->second.free.size());
  }

 private:
  struct Pool {
    std::vector<Event*> free;
    int64_t created = 0;
  };
  SpinMutex mu_;  // Short sections, taken by every device's threads.
  std::unordered_map<int32_t, Pool> pools_;
};

}  // namespace ficco

#endif  // FICCO_XLA_FFI_EVENT_POOL_H_
