// The CUDA backend (the concept: backend.h): copies are cudaMemcpyAsync on
// non-blocking side streams (copy engines, no SM kernels), events are CUDA
// events from per-device pools, flags are written and awaited by the
// streams themselves (cuStreamWriteValue32 / cuStreamWaitValue32). Host code
// only.
//
// The queue operations of the rendezvous transport are defined in
// cuda_peer_copy.cu (they may act for any rank's device, so each makes that
// device current), those of the window and push transports in cuda_window.cu
// (on the handler's own device, on streams apart from the rendezvous ones).

#ifndef FICCO_XLA_FFI_CUDA_BACKEND_H_
#define FICCO_XLA_FFI_CUDA_BACKEND_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "cuda_util.h"
#include "event_pool.h"
#include "ficco_ffi.h"
#include "gemm.h"
#include "issuer.h"
#include "peer_copy_registry.h"  // Clock
#include "xla/ffi/api/ffi.h"

namespace ficco {

namespace ffi = ::xla::ffi;

// Both transports' events, per device.
inline EventPools<CUevent_st>& CudaEventPools() {
  static auto* pools = new EventPools<CUevent_st>();
  return *pools;
}

struct CudaBackend {
  using Event = CUevent_st;  // cudaEvent_t == Event*
  using Inv = Invocation<CudaBackend>;              // rendezvous
  using WindowInv = WindowInvocation<CudaBackend>;  // window and push

  static constexpr int kPlatform = kFiccoCuda;
  // The copies read the flags the kernel bumps in place, while it runs.
  static constexpr bool kFlagsMustAlias = true;
  // Streams share the GPU's few hardware queues: a stream blocked in
  // cuStreamWaitValue32 may block others behind it, so every wait is
  // enqueued after the write it waits for (docs/windows.md, "Why the host
  // orders the waits").
  static constexpr bool kHostOrdered = true;
  // The window start's stage runs before the compute stream goes on
  // (window_protocol.h, WindowStage).
  static constexpr bool kStageBeforeCompute = true;
  // The push protocol's finish runs on XLA's stream.
  static constexpr int64_t kComputeQueue = -1;
  // The watchdog names late ranks from the flags, so the hot path builds
  // no wait descriptions.
  static constexpr bool kNamesWaits = false;
  // The rendezvous flag waits' stream; copy queues are [0, num_streams).
  static constexpr int64_t kFlagStream = int64_t{1} << 40;

  // XLA:GPU gives every device its own host thread, and each rank issues
  // the copies it receives on its own device (one thread issuing for all,
  // with the device switches, costs ~15-20 us per copy on 4xH200 and makes
  // short ops host-bound). Async issue (the default): start only publishes
  // and the device's issuer thread waits for the peers and issues, so XLA's
  // thread goes on enqueuing the next chunk's matmul; its sync still waits
  // for the issue. Parallel (selected through the C API, FiccoSetIssueMode):
  // start itself waits for the peers and issues. On 4xH200 a short
  // reduce-scatter's host floor is ~0.28 ms per call with async issue and
  // ~0.33 ms with parallel (docs/protocol.md, "Three ways to issue").
  static bool SupportsIssueMode(int mode) {
    return mode == kIssueLast || mode == kIssueParallel || mode == kIssueAsync;
  }
  static int DefaultIssueMode() { return kIssueAsync; }
  // The issuer thread is ficco's own: its device stays current, so the
  // queue operations' ScopedDevice finds it set and skips the set and
  // restore. (Should this fail, each ScopedDevice sets the device itself
  // and reports the failure where it can.)
  static void BindIssuer(int32_t device) { cudaSetDevice(device); }

  explicit CudaBackend(cudaStream_t compute) : compute(compute) {}

  // Re-recording a pooled event is safe even while earlier waits on it are
  // pending: a wait captures the event's state at the time it is enqueued.
  static ffi::ErrorOr<Event*> AcquireEvent(int32_t device) {
    return CudaEventPools().Acquire(device, CreateEvent);
  }
  static void ReleaseEvent(int32_t device, Event* e) {
    CudaEventPools().Release(device, e);
  }

  ffi::Error RecordOnCompute(int32_t, Event* e) {
    FICCO_CUDA_RETURN_IF_ERROR(cudaEventRecord(e, compute));
    return ffi::Error::Success();
  }
  // Enqueued on the compute stream: the host does not block.
  ffi::Error WaitOnCompute(int32_t, Event* e) {
    FICCO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute, e, 0));
    return ffi::Error::Success();
  }
  // XLA reuses a failed execution's buffers in compute-stream order. A
  // failing wait here leaves nothing better to do: the handler fails anyway.
  void DrainWait(Event* e, Clock::time_point /*deadline*/) {
    (void)WaitOnCompute(0, e);
  }
  ffi::Error ZeroOnCompute(void* data, size_t bytes) {
    return ZeroAsync(data, bytes, compute);
  }
  ffi::Error SetInt32OnCompute(void* data, int32_t value) {
    return SetInt32Async(data, value, compute);
  }

  // Acts for any rank's device, so it makes that device current.
  ffi::Error EnsurePeerAccess(int32_t device, int32_t peer) {
    // Checked on every start: a per-thread memo skips the process-wide lock
    // that the device threads would otherwise contend for.
    thread_local std::set<std::pair<int32_t, int32_t>> enabled;
    if (enabled.count({device, peer})) return ffi::Error::Success();
    ScopedDevice scoped;
    if (auto err = scoped.Set(device); err.failure()) return err;
    if (auto err = EnablePeerAccess(device, peer); err.failure()) return err;
    enabled.insert({device, peer});
    return ffi::Error::Success();
  }

  // Queues of the rendezvous transport (cuda_peer_copy.cu).
  FICCO_BACKEND_QUEUE_OPS(Inv)
  FICCO_BACKEND_FLAG_READY

  // Queues of the window and push transports (cuda_window.cu).
  FICCO_BACKEND_QUEUE_OPS(WindowInv)
  FICCO_BACKEND_WINDOW_OPS(WindowInv)

  // The window transports' stream of `queue` (kComputeQueue: `compute`).
  ffi::ErrorOr<cudaStream_t> WindowStream(int32_t device, int64_t queue) const;

  cudaStream_t compute;
};

}  // namespace ficco

#endif  // FICCO_XLA_FFI_CUDA_BACKEND_H_
