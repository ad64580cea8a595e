// CUDA handlers of the rendezvous transport's peer-copy protocol
// (docs/protocol.md): copies are peer cudaMemcpyAsync (unified addressing,
// peer access on) on non-blocking side streams of the receiving device (copy
// engines, no SM kernels); events are CUDA events from per-device pools;
// streams of different devices wait on each other with cudaStreamWaitEvent.
//
// Host code only: nothing here runs on the GPU's SMs.

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "cuda_util.h"
#include "event_pool.h"
#include "ficco_ffi.h"
#include "gpu_trace.h"
#include "issuer.h"
#include "peer_copy_drain.h"
#include "peer_copy_plan.h"
#include "peer_copy_protocol.h"
#include "peer_copy_registry.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {
namespace {

EventPools<CUevent_st>& Pools() {
  static auto* pools = new EventPools<CUevent_st>();
  return *pools;
}

struct CudaBackend {
  using Event = CUevent_st;  // cudaEvent_t == Event*
  using Inv = Invocation<CudaBackend>;
  static constexpr bool kFlagsMustAlias = true;
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
  // Side* calls' ScopedDevice finds it set and skips the set and restore.
  // (Should this fail, each ScopedDevice sets the device itself and reports
  // the failure where it can.)
  static void BindIssuer(int32_t device) { cudaSetDevice(device); }

  explicit CudaBackend(cudaStream_t compute) : compute(compute) {}

  static ffi::ErrorOr<Event*> AcquireEvent(int32_t device) {
    return Pools().Acquire(device, CreateEvent);
  }
  // Re-recording a pooled event is safe even while earlier waits on it are
  // pending: a wait captures the event's state at the time it is enqueued.
  static void ReleaseEvent(int32_t device, Event* e) {
    Pools().Release(device, e);
  }

  ffi::Error RecordOnCompute(int32_t, Event* e) {
    FICCO_CUDA_RETURN_IF_ERROR(cudaEventRecord(e, compute));
    return ffi::Error::Success();
  }

  // Enqueued on the compute stream: the host does not block.
  ffi::Error ComputeWait(Event* e) {
    FICCO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute, e, 0));
    return ffi::Error::Success();
  }

  // XLA reuses a failed execution's buffers in compute-stream order. A
  // failing wait here leaves nothing better to do: the handler fails anyway.
  void DrainWait(Event* e, Clock::time_point /*deadline*/) {
    (void)ComputeWait(e);
  }

  // The Side* calls and peer access act for any rank's device (the last
  // rank to arrive issues for all), so each makes that device current.
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

  ffi::Error SideWait(const std::shared_ptr<Inv>&, int32_t device,
                      int64_t stream, Event* e) {
    ScopedDevice scoped;
    if (auto err = scoped.Set(device); err.failure()) return err;
    auto side = SideStream(device, stream);
    if (!side.has_value()) return side.error();
    FICCO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(*side, e, 0));
    return ffi::Error::Success();
  }

  // A copy is cudaMemcpyAsync(cudaMemcpyDefault), which unified addressing
  // routes to the receiver's copy engine once peer access is on. It costs
  // the host ~5 us less per copy than cudaMemcpyPeerAsync (on 4xH200 an
  // all-gather start's issue of 3 copies takes ~18 us rather than ~33).
  ffi::Error SideCopy(const std::shared_ptr<Inv>&, int32_t device,
                      int64_t stream, char* dst, const char* src,
                      int32_t /*src_device*/, size_t bytes) {
    if (bytes == 0) return ffi::Error::Success();
    ScopedDevice scoped;
    if (auto err = scoped.Set(device); err.failure()) return err;
    auto side = SideStream(device, stream);
    if (!side.has_value()) return side.error();
    GpuTrace::Get().Stamp(device, *side, kTraceGpuCopyBegin);
    FICCO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, *side));
    GpuTrace::Get().Stamp(device, *side, kTraceGpuCopyEnd);
    return ffi::Error::Success();
  }

  ffi::Error SideRecord(const std::shared_ptr<Inv>&, int32_t device,
                        int64_t stream, Event* e) {
    ScopedDevice scoped;
    if (auto err = scoped.Set(device); err.failure()) return err;
    auto side = SideStream(device, stream);
    if (!side.has_value()) return side.error();
    FICCO_CUDA_RETURN_IF_ERROR(cudaEventRecord(e, *side));
    return ffi::Error::Success();
  }

  ffi::Error ZeroOnCompute(void* data, size_t bytes) {
    return ZeroAsync(data, bytes, compute);
  }

  ffi::Error SetInt32OnCompute(void* data, int32_t value) {
    return SetInt32Async(data, value, compute);
  }

  // `out` fires once `*flag >= target`, counted after `after` (the arm's
  // zeroing). On the device's flag stream, enqueued after the kernel that
  // bumps the flag was launched, so the wait never stands before its
  // producer in any hardware queue (docs/protocol.md, "Flagged starts").
  // One stream takes all of a start's flag waits, in piece order, which is
  // the order the kernel completes them: pieces complete in order where a
  // piece has at least as many tiles as the kernel has CTAs, so one
  // stream's waits in flag order lose nothing; where it has fewer, a later
  // piece may finish first and wait for an earlier one's flag (later, never
  // wrong). A stream per flag gains nothing measurable.
  // No host bound here: the kernel is enqueued and always completes.
  ffi::Error FlagReady(int32_t device, int64_t /*flag_index*/,
                       const int32_t* flag, int64_t target, Event* after,
                       Event* out, int64_t /*timeout_ms*/) {
    if (Ops().wait == nullptr) return ffi::Error::Internal(Ops().error);
    ScopedDevice scoped;
    if (auto err = scoped.Set(device); err.failure()) return err;
    auto stream = SideStream(device, kFlagStream);
    if (!stream.has_value()) return stream.error();
    FICCO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(*stream, after, 0));
    if (auto err = CheckCu(
            Ops().wait(reinterpret_cast<CUstream>(*stream),
                       reinterpret_cast<CUdeviceptr>(flag),
                       static_cast<cuuint32_t>(target),
                       CU_STREAM_WAIT_VALUE_GEQ),
            "cuStreamWaitValue32");
        err.failure()) {
      return err;
    }
    FICCO_CUDA_RETURN_IF_ERROR(cudaEventRecord(out, *stream));
    return ffi::Error::Success();
  }

  // Copy queues are indices [0, num_streams); this is far past them.
  static constexpr int64_t kFlagStream = int64_t{1} << 40;

  cudaStream_t compute;
};

ffi::Error StartImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                     ffi::RemainingArgs args, ffi::RemainingRets rets,
                     StartAttrs attrs) {
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  CudaBackend backend(stream);
  GpuTrace::Get().Stamp(device, stream, kTraceGpuStart);
  ffi::Error err = Start(backend, run_id.run_id, device, args, rets, attrs);
  if (err.failure()) {
    DrainFailedRun(backend, run_id.run_id, device, err.message());
  }
  return err;
}

ffi::Error SyncImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                    ffi::RemainingArgs args, ffi::RemainingRets rets,
                    SyncAttrs attrs) {
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  CudaBackend backend(stream);
  // A failing sync ends this device's execution once the copies of what it
  // still had registered have ended (peer_copy_drain.h).
  auto fail = [&](ffi::Error err) {
    DrainFailedRun(backend, run_id.run_id, device, err.message());
    return err;
  };
  auto call = DecodeSync(args, rets, attrs);
  if (!call.has_value()) return fail(call.error());
  if (auto why = SyncFault(device, !call->waits.empty(),
                           !call->groups.empty(), attrs.op_name);
      !why.empty()) {
    return fail(ffi::Error(ffi::ErrorCode::kUnavailable, why));
  }
  GpuTrace::Get().Stamp(device, stream, kTraceGpuSyncIn);
  ffi::Error err = BlockingSync(backend, run_id.run_id, device, *call, attrs);
  GpuTrace::Get().Stamp(device, stream, kTraceGpuSyncOut);
  return err.failure() ? fail(std::move(err)) : err;
}

ffi::Error ArmImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                   ffi::RemainingArgs /*like*/, ffi::RemainingRets rets,
                   ArmAttrs attrs) {
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  CudaBackend backend(stream);
  ffi::Error err = Arm(backend, run_id.run_id, device, rets, attrs);
  if (err.failure()) {
    DrainFailedRun(backend, run_id.run_id, device, err.message());
  }
  return err;
}

}  // namespace

int64_t CudaLiveInvocations() { return Invocation<CudaBackend>::live.load(); }
int64_t CudaPendingEntries() { return Registry<CudaBackend>::Get().Pending(); }
void CudaEventCounts(int device, int64_t* created, int64_t* pooled) {
  Pools().Counts(device, created, pooled);
}
bool CudaHostStat(int stat, int64_t* calls, int64_t* ns) {
  return Registry<CudaBackend>::Get().stats().Read(stat, calls, ns);
}
void CudaHostStatsReset() { Registry<CudaBackend>::Get().stats().Reset(); }
int CudaSetIssueMode(int mode) { return SetIssueMode<CudaBackend>(mode); }
int CudaIssueMode() { return Registry<CudaBackend>::Get().mode().load(); }
bool CudaTraceGpuEnable(int64_t per_device) {
  return GpuTrace::Get().Enable(per_device);
}
void CudaTraceGpuDisable() { GpuTrace::Get().Disable(); }
int64_t CudaTraceGpuTimes(int device, int64_t* out, int64_t max) {
  return GpuTrace::Get().Times(device, out, max);
}
}  // namespace ficco

// Not command-buffer compatible (no ffi::Traits): a CUDA graph would freeze
// the host rendezvous and the buffer addresses of the captured call.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoPeerCopyStartCuda, ficco::StartImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::RunId>()                         // execution
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .RemainingArgs()                                // sources
        .RemainingRets()                                // landings
        .Attrs<ficco::StartAttrs>());                   // plan

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoPeerCopySyncCuda, ficco::SyncImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::RunId>()                         // execution
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .RemainingArgs()                                // outs, keepalive
        .RemainingRets()                                // outs, aliased
        .Attrs<ficco::SyncAttrs>());                    // layout, messages

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoFlagsArmCuda, ficco::ArmImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::RunId>()                         // execution
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .RemainingArgs()                                // types only
        .RemainingRets()                                // flags, rank, landings
        .Attrs<ficco::ArmAttrs>());                     // site, messages
