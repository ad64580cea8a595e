// The C API of ficco_ffi.h that is not a handler: what was compiled in,
// per-platform counters, the host timeline, and the never-arrive test hook.

#include <atomic>
#include <cstdint>

#include "ficco_ffi.h"
#include "host_trace.h"
#include "peer_copy_registry.h"

namespace ficco {
namespace {
// (device, step) of the fault hook; device -1: off.
std::atomic<int64_t> fault{-1};
int64_t FaultKey(int device, int step) {
  return device < 0 ? -1 : (int64_t{device} << 8) | step;
}
}  // namespace

bool Faults(int32_t device, int step) {
  return fault.load() == FaultKey(device, step);
}

}  // namespace ficco

extern "C" {

int FiccoCudaCompiled(void) {
#ifdef FICCO_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

int64_t FiccoLiveInvocations(int platform) {
  if (platform == kFiccoCpu) return ficco::CpuLiveInvocations();
#ifdef FICCO_WITH_CUDA
  if (platform == kFiccoCuda) return ficco::CudaLiveInvocations();
#endif
  return -1;
}

int64_t FiccoPendingEntries(int platform) {
  if (platform == kFiccoCpu) return ficco::CpuPendingEntries();
#ifdef FICCO_WITH_CUDA
  if (platform == kFiccoCuda) return ficco::CudaPendingEntries();
#endif
  return -1;
}

int FiccoEventCounts(int platform, int device, int64_t* created,
                     int64_t* pooled) {
  if (platform == kFiccoCpu) {
    ficco::CpuEventCounts(device, created, pooled);
    return 0;
  }
#ifdef FICCO_WITH_CUDA
  if (platform == kFiccoCuda) {
    ficco::CudaEventCounts(device, created, pooled);
    return 0;
  }
#endif
  return -1;
}

int FiccoHostStats(int platform, int stat, int64_t* calls, int64_t* ns) {
  if (platform == kFiccoCpu) {
    return ficco::CpuHostStat(stat, calls, ns) ? 0 : -1;
  }
#ifdef FICCO_WITH_CUDA
  if (platform == kFiccoCuda) {
    return ficco::CudaHostStat(stat, calls, ns) ? 0 : -1;
  }
#endif
  return -1;
}

void FiccoHostStatsReset(int platform) {
  if (platform == kFiccoCpu) ficco::CpuHostStatsReset();
#ifdef FICCO_WITH_CUDA
  if (platform == kFiccoCuda) ficco::CudaHostStatsReset();
#endif
}

int FiccoSetIssueMode(int platform, int mode) {
  if (platform == kFiccoCpu) return ficco::CpuSetIssueMode(mode);
#ifdef FICCO_WITH_CUDA
  if (platform == kFiccoCuda) return ficco::CudaSetIssueMode(mode);
#endif
  return -1;
}

int FiccoIssueMode(int platform) {
  if (platform == kFiccoCpu) return ficco::CpuIssueMode();
#ifdef FICCO_WITH_CUDA
  if (platform == kFiccoCuda) return ficco::CudaIssueMode();
#endif
  return -1;
}

#ifdef FICCO_WITH_TRACE
int FiccoTraceCompiled(void) { return 1; }
int FiccoTraceEnable(int64_t capacity) {
  return ficco::HostTrace::Get().Enable(capacity) ? 0 : -1;
}
void FiccoTraceDisable(void) {
  ficco::HostTrace::Get().Disable();
#ifdef FICCO_WITH_CUDA
  ficco::CudaTraceGpuDisable();
#endif
}
int FiccoTraceGpuEnable(int64_t per_device) {
#ifdef FICCO_WITH_CUDA
  return ficco::CudaTraceGpuEnable(per_device) ? 0 : -1;
#else
  (void)per_device;
  return -1;
#endif
}
int64_t FiccoTraceGpuTimes(int device, int64_t* out, int64_t max) {
#ifdef FICCO_WITH_CUDA
  return ficco::CudaTraceGpuTimes(device, out, max);
#else
  (void)device, (void)out, (void)max;
  return -1;
#endif
}
int64_t FiccoTraceRead(int64_t* out, int64_t max_events, int64_t* recorded) {
  return ficco::HostTrace::Get().Read(out, max_events, recorded);
}
#else   // !FICCO_WITH_TRACE: the C API stays, and says so.
int FiccoTraceCompiled(void) { return 0; }
int FiccoTraceEnable(int64_t) { return -2; }
void FiccoTraceDisable(void) {}
int FiccoTraceGpuEnable(int64_t) { return -1; }
int64_t FiccoTraceGpuTimes(int, int64_t*, int64_t) { return -1; }
int64_t FiccoTraceRead(int64_t*, int64_t, int64_t* recorded) {
  *recorded = 0;
  return 0;
}
#endif  // FICCO_WITH_TRACE
void FiccoTraceMark(int device, int64_t tag) {
  ficco::Trace(device, ficco::kTraceMark, tag);
}

void FiccoTestSetNeverArrive(int device) {
  ficco::fault.store(ficco::FaultKey(device, ficco::kFaultStart));
}
void FiccoTestSetFault(int device, int step) {
  ficco::fault.store(ficco::FaultKey(device, step));
}
void FiccoTestClearFaults(void) { ficco::fault.store(-1); }

}  // extern "C"
