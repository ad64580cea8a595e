// An opt-in, process-wide timeline of the peer-copy handlers' host events
// (FiccoTrace* in ficco_ffi.h; Python `library.trace_*`).
//
// Why: host-bound reduce-scatters can run in two modes whole rounds at a
// time (on 4xH200, ~0.21 against ~0.26 ms per call at llama3-8b M4096),
// and the summed counters of FiccoHostStats cannot say which thread stalls,
// where, or on which CPU. A profiler inflates every CUDA call. This records,
// per event, a steady-clock time, the device, the point in the protocol,
// the CPU the thread ran on and a tag (the call site), in a preallocated
// array claimed by one atomic add: a clock read, sched_getcpu and the add
// per event while on, one relaxed load while off.
//
// A build option (CMake FICCO_TRACE=ON defines FICCO_WITH_TRACE): without
// it every trace point compiles to nothing and FiccoTraceEnable reports the
// timeline as not compiled in, so the product library carries no tracing.

#ifndef FICCO_XLA_FFI_HOST_TRACE_H_
#define FICCO_XLA_FFI_HOST_TRACE_H_

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>

namespace ficco {

// Values of the C API (ficco_ffi.h); library.TRACE_POINTS names them.
enum TracePoint : int32_t {
  kTraceStartEnter = 0,  // XLA's thread enters start
  kTraceStartExit,       // ... and leaves it
  kTraceIssueBegin,      // the issuer (or a parallel start) begins
  kTracePeersArrived,    // every rank has published
  kTraceIssueEnd,        // this rank's copies are enqueued
  kTraceSyncEnter,       // XLA's thread enters sync
  kTraceSyncIssued,      // every part of the sync is issued
  kTraceSyncExit,        // ... and sync leaves
  kTraceMark,            // FiccoTraceMark (e.g. Python's dispatch)
  // GPU stamps (gpu_trace.h; the tag is the stamp's index on its device):
  kTraceGpuStart,        // compute stream, as start is enqueued
  kTraceGpuSyncIn,       // compute stream, before sync's waits
  kTraceGpuSyncOut,      // compute stream, after them
  kTraceGpuCopyBegin,    // side stream, before a copy (after its waits)
  kTraceGpuCopyEnd,      // side stream, after it
};

#ifdef FICCO_WITH_TRACE

class HostTrace {
 public:
  static HostTrace& Get() {
    static HostTrace* trace = new HostTrace();  // Leaked: handlers may run
    return *trace;                              // at interpreter exit.
  }

  // Starts a trace of at most `capacity` events, dropping the previous one;
  // false if the array cannot be allocated (tracing stays off). Call only
  // while no op is in flight. Each trace owns its array, capacity and
  // counter, so a handler that still holds the previous one writes inside
  // it; that one stays allocated until the next Enable.
  bool Enable(int64_t capacity) {
    std::lock_guard<std::mutex> lock(mu_);
    active_.store(nullptr, std::memory_order_release);
    retired_ = std::move(current_);
    if (capacity <= 0) return true;
    std::unique_ptr<Buffer> b(new (std::nothrow) Buffer);
    if (b == nullptr) return false;
    // Value-initialised: a slot claimed but not yet written reads as zeros.
    b->events.reset(new (std::nothrow) Event[capacity]());
    if (b->events == nullptr) return false;
    b->capacity = capacity;
    current_ = std::move(b);
    active_.store(current_.get(), std::memory_order_release);
    return true;
  }

  void Disable() { active_.store(nullptr, std::memory_order_release); }

  void Record(int32_t device, TracePoint point, int64_t tag) {
    Buffer* b = active_.load(std::memory_order_acquire);
    if (b == nullptr) return;
    const int64_t i = b->next.fetch_add(1, std::memory_order_relaxed);
    if (i >= b->capacity) return;  // Full: later events are counted only.
    b->events[i] = {std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count(),
                    device, static_cast<int32_t>(point), sched_getcpu(), tag};
  }

  // Copies up to `max_events` of the kept events as 4 int64 each (time in
  // ns, device, point + cpu * 65536, tag) into `out` and returns how many it
  // copied; `*recorded` becomes how many were recorded, kept or not (more
  // than the capacity if the trace overflowed).
  int64_t Read(int64_t* out, int64_t max_events, int64_t* recorded) {
    std::lock_guard<std::mutex> lock(mu_);
    *recorded = 0;
    if (current_ == nullptr) return 0;
    const Buffer& b = *current_;
    const int64_t n = b.next.load(std::memory_order_acquire);
    int64_t copied = n < b.capacity ? n : b.capacity;
    if (copied > max_events) copied = max_events;
    for (int64_t i = 0; i < copied; ++i) {
      const Event& e = b.events[i];
      out[4 * i] = e.t_ns;
      out[4 * i + 1] = e.device;
      // A multiplication, not a shift: cpu is -1 if sched_getcpu fails.
      out[4 * i + 2] = e.point + static_cast<int64_t>(e.cpu) * 65536;
      out[4 * i + 3] = e.tag;
    }
    *recorded = n;
    return copied;
  }

 private:
  struct Event {
    int64_t t_ns;
    int32_t device, point, cpu;
    int64_t tag;
  };
  struct Buffer {
    std::unique_ptr<Event[]> events;
    int64_t capacity = 0;
    std::atomic<int64_t> next{0};
  };

  std::mutex mu_;
  std::unique_ptr<Buffer> current_, retired_;
  std::atomic<Buffer*> active_{nullptr};
};

inline void Trace(int32_t device, TracePoint point, int64_t tag) {
  HostTrace::Get().Record(device, point, tag);
}

#else  // !FICCO_WITH_TRACE

inline void Trace(int32_t, TracePoint, int64_t) {}

#endif  // FICCO_WITH_TRACE

}  // namespace ficco

#endif  // FICCO_XLA_FFI_HOST_TRACE_H_
