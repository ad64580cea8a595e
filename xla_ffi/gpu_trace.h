// GPU timestamps for the host timeline (host_trace.h), CUDA only: timing
// events recorded on the compute stream at each start and around each sync,
// and on the side stream around each copy. Opt-in (FiccoTraceGpuEnable):
// each stamp costs the host a cudaEventRecord (~2 us).
//
// Why: the host timeline of a host-bound reduce-scatter can show its slow
// rounds spending longer in XLA's own execute path, which is what a host
// throttled by a full launch queue looks like, as well as a slower host.
// Stamps tell the two apart: a stamp's GPU time minus its host
// time, less the smallest such difference on its device, is how far the GPU
// ran behind the host (zero: the GPU waited for the host); and the intervals
// between stamps show where the GPU's time went (matmuls, the wait for the
// copies, the copies themselves).
//
// Each stamp takes the next of its device's preallocated events and records
// a host-timeline event whose tag is that event's index; FiccoTraceGpuTimes
// reads the GPU times, per device, relative to that device's first stamp.
// Compiled only with the timeline (FICCO_WITH_TRACE, host_trace.h); without
// it GpuStamp is empty.

#ifndef FICCO_XLA_FFI_GPU_TRACE_H_
#define FICCO_XLA_FFI_GPU_TRACE_H_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "host_trace.h"

namespace ficco {

#ifdef FICCO_WITH_TRACE

class GpuTrace {
 public:
  static GpuTrace& Get() {
    static GpuTrace* trace = new GpuTrace();  // Leaked, as HostTrace.
    return *trace;
  }

  // Creates (once) `per_device` timing events on every visible device and
  // starts stamping; call it only while no op is in flight. Returns false
  // if CUDA fails (stamping stays off).
  bool Enable(int64_t per_device) {
    Disable();
    int count = 0, previous = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess ||
        cudaGetDevice(&previous) != cudaSuccess) {
      return false;
    }
    while (static_cast<int>(devices_.size()) < count) {
      devices_.push_back(std::make_unique<Device>());
    }
    bool ok = true;
    for (int d = 0; d < count && ok; ++d) {
      Device& dev = *devices_[d];
      dev.next.store(0);
      if (static_cast<int64_t>(dev.events.size()) >= per_device) continue;
      ok = cudaSetDevice(d) == cudaSuccess;
      while (ok && static_cast<int64_t>(dev.events.size()) < per_device) {
        cudaEvent_t e;
        ok = cudaEventCreate(&e) == cudaSuccess;
        if (ok) dev.events.push_back(e);
      }
    }
    cudaSetDevice(previous);
    per_device_ = per_device;
    enabled_.store(ok, std::memory_order_release);
    return ok;
  }

  void Disable() { enabled_.store(false, std::memory_order_release); }

  // Records the next event of `device` on `stream` (current device:
  // `device`) and a host-timeline event `point` tagged with its index.
  void Stamp(int32_t device, cudaStream_t stream, TracePoint point) {
    if (!enabled_.load(std::memory_order_acquire)) return;
    if (device < 0 || device >= static_cast<int32_t>(devices_.size())) return;
    Device& dev = *devices_[device];
    const int64_t i = dev.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= per_device_) return;
    if (cudaEventRecord(dev.events[i], stream) != cudaSuccess) return;
    Trace(device, point, i);
  }

  // GPU time in ns of each stamp of `device`, relative to its first, into
  // `out` (at most `max`); returns how many, or -1 on a CUDA error. Blocks
  // until the stamps have run: read after the traced ops finished.
  int64_t Times(int32_t device, int64_t* out, int64_t max) {
    if (device < 0 || device >= static_cast<int32_t>(devices_.size())) {
      return 0;
    }
    Device& dev = *devices_[device];
    int64_t n = dev.next.load();
    if (n > per_device_) n = per_device_;
    if (n > max) n = max;
    for (int64_t i = 0; i < n; ++i) {
      float ms = 0;
      if (cudaEventSynchronize(dev.events[i]) != cudaSuccess ||
          cudaEventElapsedTime(&ms, dev.events[0], dev.events[i]) !=
              cudaSuccess) {
        return -1;
      }
      out[i] = static_cast<int64_t>(static_cast<double>(ms) * 1e6);
    }
    return n;
  }

 private:
  struct Device {
    std::vector<cudaEvent_t> events;
    std::atomic<int64_t> next{0};
  };
  std::vector<std::unique_ptr<Device>> devices_;
  int64_t per_device_ = 0;
  std::atomic<bool> enabled_{false};
};

inline void GpuStamp(int32_t device, cudaStream_t stream, TracePoint point) {
  GpuTrace::Get().Stamp(device, stream, point);
}

#else  // !FICCO_WITH_TRACE

inline void GpuStamp(int32_t, cudaStream_t, TracePoint) {}

#endif  // FICCO_WITH_TRACE

}  // namespace ficco

#endif  // FICCO_XLA_FFI_GPU_TRACE_H_
