// CUDA handlers of the peer-copy protocol: copies are peer cudaMemcpyAsync
// (unified addressing, peer access on) on non-blocking side streams of the
// receiving device (copy engines, no SM kernels); events are CUDA events from per-device pools; streams of
// different devices wait on each other with cudaStreamWaitEvent.
//
// Host code only: nothing here runs on the GPU's SMs.

#include <cuda.h>  // Types of the stream memory operations only.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "cuda_util.h"
#include "event_pool.h"
#include "ficco_ffi.h"
#include "issuer.h"
#include "peer_copy_plan.h"
#include "peer_copy_protocol.h"
#include "peer_copy_registry.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {
namespace {

// The async mode's flags: one 32-bit word per (device, copy queue) in
// mapped pinned host memory, which every GPU can poll and write. A queue
// writes its word after each copy (cuStreamWriteValue32), with values that
// start assigned in program order; a compute stream waits until the word
// reaches a value (cuStreamWaitValue32). The driver's stream memory
// operations are reached through the runtime's entry-point query, so the
// library still links cudart statically and nothing else.
constexpr int kFlagDevices = 64;
constexpr int kFlagQueues = 64;

struct FlagTable {
  using WaitFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  using WriteFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  uint32_t* words = nullptr;
  WaitFn wait = nullptr;
  WriteFn write = nullptr;
  std::atomic<uint32_t> next[kFlagDevices][kFlagQueues] = {};
  // The last value each queue was told to write (diagnostics of a stall:
  // FiccoFlagState): assigned > signalled is an issue not yet made, and
  // signalled > the word a write the queue has not yet reached.
  std::atomic<uint32_t> signalled[kFlagDevices][kFlagQueues] = {};

  CUdeviceptr Address(int32_t device, int64_t stream) const {
    return reinterpret_cast<CUdeviceptr>(words + device * kFlagQueues + stream);
  }
};

ffi::Error CheckDriver(CUresult status, const char* call) {
  if (status == CUDA_SUCCESS) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(call) + " failed: CUresult " +
                              std::to_string(static_cast<int>(status)));
}

ffi::ErrorOr<FlagTable*> MakeFlags() {
  auto* table = new FlagTable();  // Leaked: copy queues may outlive exit.
  void* words = nullptr;
  if (auto err = Check(cudaHostAlloc(&words, sizeof(uint32_t) * kFlagDevices *
                                                 kFlagQueues,
                                     cudaHostAllocMapped | cudaHostAllocPortable),
                       "cudaHostAlloc(flags)");
      err.failure()) {
    return ffi::Unexpected(err);
  }
  std::memset(words, 0, sizeof(uint32_t) * kFlagDevices * kFlagQueues);
  table->words = static_cast<uint32_t*>(words);
  for (auto [name, fn] : {std::make_pair("cuStreamWaitValue32",
                                         reinterpret_cast<void**>(&table->wait)),
                          std::make_pair("cuStreamWriteValue32",
                                         reinterpret_cast<void**>(&table->write))}) {
    cudaDriverEntryPointQueryResult found;
    if (auto err = Check(cudaGetDriverEntryPointByVersion(
                             name, fn, 12000, cudaEnableDefault, &found),
                         "cudaGetDriverEntryPointByVersion");
        err.failure()) {
      return ffi::Unexpected(err);
    }
    if (found != cudaDriverEntryPointSuccess || *fn == nullptr) {
      return ffi::Unexpected(ffi::Error(
          ffi::ErrorCode::kUnimplemented,
          std::string("the driver has no ") + name +
              ", which async issue needs (set FICCO_CUDA_ISSUE=parallel)"));
    }
  }
  return table;
}

// Created on first use, with whichever device is current (the memory is
// portable: every context maps it at the same address under unified
// addressing).
// nullptr (and the reason in *error) if the table cannot be made.
FlagTable* Flags(ffi::Error* error) {
  static auto* flags = new ffi::ErrorOr<FlagTable*>(MakeFlags());
  if (flags->has_value()) return **flags;
  *error = ffi::Error(flags->error().errc().value_or(ffi::ErrorCode::kInternal),
                      flags->error().message());
  return nullptr;
}

EventPools<CUevent_st>& Pools() {
  static auto* pools = new EventPools<CUevent_st>();
  return *pools;
}

struct CudaBackend {
  using Event = CUevent_st;  // cudaEvent_t == Event*
  using Inv = Invocation<CudaBackend>;
  // XLA:GPU gives every device its own host thread. Parallel issue (the
  // default): each rank waits for its peers in start and enqueues the
  // copies it receives itself, so the host work is spread over P threads
  // and never switches devices (one thread issuing for all, with the device
  // switches, cost ~15-20 us per copy on 4xH200 and made short ops
  // host-bound). Async issue (FICCO_CUDA_ISSUE=async, or the C API): start
  // only publishes, the device's issuer thread waits for the peers and
  // issues, and sync's compute-stream waits are on flags the copy queues
  // write (below), so XLA's thread never waits for a peer's issue. It cut
  // the host floor by 30-50 us per call, but one benchmark run under it
  // stalled (benchmarks/RESULTS.md, session 9), so it is not the default.
  static constexpr int kPlatform = 1;
  static constexpr bool kDeviceFlags = true;
  static int DefaultIssueMode() {
    return IssueModeFromEnv("FICCO_CUDA_ISSUE", kIssueParallel);
  }

  // The flag value the next copy on (device, queue) writes once landed.
  static ffi::ErrorOr<uint32_t> NextSeq(int32_t device, int64_t stream) {
    ffi::Error error = ffi::Error::Success();
    FlagTable* flags = Flags(&error);
    if (flags == nullptr) return ffi::Unexpected(error);
    if (device < 0 || device >= kFlagDevices || stream < 0 ||
        stream >= kFlagQueues) {
      return ffi::Unexpected(ffi::Error::InvalidArgument(
          "async issue supports devices < " + std::to_string(kFlagDevices) +
          " and copy queues < " + std::to_string(kFlagQueues) + "; got device " +
          std::to_string(device) + ", queue " + std::to_string(stream) +
          " (set FICCO_CUDA_ISSUE=parallel)"));
    }
    return flags->next[device][stream].fetch_add(1) + 1;
  }

  // In order after the copies before it on the queue (the write is fenced).
  ffi::Error SideSignal(const std::shared_ptr<Inv>&, int32_t device,
                        int64_t stream, uint32_t seq) {
    ffi::Error error = ffi::Error::Success();
    FlagTable* flags = Flags(&error);
    if (flags == nullptr) return error;
    ScopedDevice scoped;
    if (auto err = scoped.Set(device); err.failure()) return err;
    auto side = SideStream(device, stream);
    if (!side.has_value()) return side.error();
    if (auto err = CheckDriver(
            flags->write(*side, flags->Address(device, stream), seq,
                         CU_STREAM_WRITE_VALUE_DEFAULT),
            "cuStreamWriteValue32");
        err.failure()) {
      return err;
    }
    flags->signalled[device][stream].store(seq);
    return ffi::Error::Success();
  }

  // Enqueued on the compute stream: it waits, the host does not. GEQ is a
  // cyclic comparison, so the 32-bit values may wrap.
  ffi::Error ComputeWaitFlag(int32_t device, int64_t stream, uint32_t seq) {
    ffi::Error error = ffi::Error::Success();
    FlagTable* flags = Flags(&error);
    if (flags == nullptr) return error;
    return CheckDriver(
        flags->wait(compute, flags->Address(device, stream), seq,
                       CU_STREAM_WAIT_VALUE_GEQ),
        "cuStreamWaitValue32");
  }

  // How a copy is enqueued: cudaMemcpyAsync(cudaMemcpyDefault), which
  // unified addressing routes to the receiver's copy engine once peer access
  // is on, or, with FICCO_CUDA_MEMCPY=peer (for measurements),
  // cudaMemcpyPeerAsync. The former costs the host ~5 us less per copy
  // (4xH200, benchmarks/results/h200x4_session5_b/host_floor_*: an
  // all-gather start's issue of 3 copies 33 -> 18 us).
  static bool PeerMemcpy() {
    static const bool peer = [] {
      const char* v = std::getenv("FICCO_CUDA_MEMCPY");
      return v != nullptr && std::string(v) == "peer";
    }();
    return peer;
  }

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

  ffi::Error SideCopy(const std::shared_ptr<Inv>&, int32_t device,
                      int64_t stream, char* dst, const char* src,
                      int32_t src_device, size_t bytes) {
    if (bytes == 0) return ffi::Error::Success();
    ScopedDevice scoped;
    if (auto err = scoped.Set(device); err.failure()) return err;
    auto side = SideStream(device, stream);
    if (!side.has_value()) return side.error();
    if (PeerMemcpy()) {
      FICCO_CUDA_RETURN_IF_ERROR(
          cudaMemcpyPeerAsync(dst, device, src, src_device, bytes, *side));
    } else {
      FICCO_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, *side));
    }
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

  cudaStream_t compute;
};

ffi::Error StartImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                     ffi::RemainingArgs args, ffi::RemainingRets rets,
                     StartAttrs attrs) {
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  CudaBackend backend(stream);
  return Start(backend, run_id.run_id, device, args, rets, attrs);
}

ffi::Error SyncImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                    ffi::RemainingArgs args, ffi::RemainingRets rets,
                    SyncAttrs attrs) {
  auto call = DecodeSync(args, rets, attrs);
  if (!call.has_value()) return call.error();
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  CudaBackend backend(stream);
  return BlockingSync(backend, run_id.run_id, device, *call, attrs);
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
int CudaSetIssueMode(int mode) {
  if (mode != kIssueLast && mode != kIssueParallel && mode != kIssueAsync) {
    return -1;
  }
  return Registry<CudaBackend>::Get().mode().exchange(mode);
}
int CudaIssueMode() { return Registry<CudaBackend>::Get().mode().load(); }
int CudaFlagState(int device, int queue, uint32_t* word, uint32_t* assigned,
                  uint32_t* signalled) {
  if (device < 0 || device >= kFlagDevices || queue < 0 ||
      queue >= kFlagQueues) {
    return -1;
  }
  ffi::Error error = ffi::Error::Success();
  FlagTable* flags = Flags(&error);
  if (flags == nullptr) return -1;
  *word = reinterpret_cast<volatile uint32_t*>(flags->words)[device * kFlagQueues + queue];
  *assigned = flags->next[device][queue].load();
  *signalled = flags->signalled[device][queue].load();
  return 0;
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
