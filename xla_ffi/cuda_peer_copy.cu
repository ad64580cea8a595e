// CUDA handlers of the rendezvous transport's peer-copy protocol
// (docs/protocol.md), and the CUDA backend's rendezvous queues
// (cuda_backend.h): copies are peer cudaMemcpyAsync (unified addressing,
// peer access on) on non-blocking side streams of the receiving device;
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

#include "cuda_backend.h"
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

// The rendezvous transport's queues act for any rank's device (the last
// rank to arrive may issue for all), so each makes that device current.
ffi::Error CudaBackend::WaitEvent(const std::shared_ptr<Inv>&, int32_t device,
                                  int64_t queue, Event* e) {
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  auto side = SideStream(device, queue);
  if (!side.has_value()) return side.error();
  FICCO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(*side, e, 0));
  return ffi::Error::Success();
}

// A copy is cudaMemcpyAsync(cudaMemcpyDefault), which unified addressing
// routes to the receiver's copy engine once peer access is on. It costs
// the host ~5 us less per copy than cudaMemcpyPeerAsync (on 4xH200 an
// all-gather start's issue of 3 copies takes ~18 us rather than ~33).
ffi::Error CudaBackend::Copy(const std::shared_ptr<Inv>&, int32_t device,
                             int64_t queue, char* dst, const char* src,
                             size_t bytes) {
  if (bytes == 0) return ffi::Error::Success();
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  auto side = SideStream(device, queue);
  if (!side.has_value()) return side.error();
  GpuStamp(device, *side, kTraceGpuCopyBegin);
  FICCO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, *side));
  GpuStamp(device, *side, kTraceGpuCopyEnd);
  return ffi::Error::Success();
}

ffi::Error CudaBackend::Record(const std::shared_ptr<Inv>&, int32_t device,
                               int64_t queue, Event* e) {
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  auto side = SideStream(device, queue);
  if (!side.has_value()) return side.error();
  FICCO_CUDA_RETURN_IF_ERROR(cudaEventRecord(e, *side));
  return ffi::Error::Success();
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
ffi::Error CudaBackend::FlagReady(int32_t device, int64_t /*flag_index*/,
                                  const int32_t* flag, int64_t target,
                                  Event* after, Event* out,
                                  int64_t /*timeout_ms*/) {
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

namespace {

ffi::Error StartImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                     ffi::RemainingArgs args, ffi::RemainingRets rets,
                     Attrs attrs) {
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  CudaBackend backend(stream);
  GpuStamp(device, stream, kTraceGpuStart);
  ffi::Error err = Start(backend, run_id.run_id, /*instance=*/0, device, args,
                         rets, attrs);
  if (err.failure()) {
    DrainFailedRun(backend, run_id.run_id, device, err.message());
  }
  return err;
}

ffi::Error SyncImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                    ffi::RemainingArgs args, ffi::RemainingRets rets,
                    Attrs attrs) {
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
  GpuStamp(device, stream, kTraceGpuSyncIn);
  ffi::Error err = BlockingSync(backend, run_id.run_id, device, *call, attrs);
  GpuStamp(device, stream, kTraceGpuSyncOut);
  return err.failure() ? fail(std::move(err)) : err;
}

ffi::Error ArmImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                   ffi::RemainingArgs /*like*/, ffi::RemainingRets rets,
                   Attrs attrs) {
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
  CudaEventPools().Counts(device, created, pooled);
}
bool CudaHostStat(int stat, int64_t* calls, int64_t* ns) {
  return Registry<CudaBackend>::Get().stats().Read(stat, calls, ns);
}
void CudaHostStatsReset() { Registry<CudaBackend>::Get().stats().Reset(); }
int CudaSetIssueMode(int mode) { return SetIssueMode<CudaBackend>(mode); }
int CudaIssueMode() { return Registry<CudaBackend>::Get().mode().load(); }
#ifdef FICCO_WITH_TRACE
bool CudaTraceGpuEnable(int64_t per_device) {
  return GpuTrace::Get().Enable(per_device);
}
void CudaTraceGpuDisable() { GpuTrace::Get().Disable(); }
int64_t CudaTraceGpuTimes(int device, int64_t* out, int64_t max) {
  return GpuTrace::Get().Times(device, out, max);
}
#endif
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
        .Attrs<ficco::Attrs>());                   // plan

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoPeerCopySyncCuda, ficco::SyncImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::RunId>()                         // execution
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .RemainingArgs()                                // outs, keepalive
        .RemainingRets()                                // outs, aliased
        .Attrs<ficco::Attrs>());                    // layout, messages

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoFlagsArmCuda, ficco::ArmImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::RunId>()                         // execution
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .RemainingArgs()                                // types only
        .RemainingRets()                                // flags, rank, landings
        .Attrs<ficco::Attrs>());                     // site, messages
