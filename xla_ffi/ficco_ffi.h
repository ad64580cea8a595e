// Public symbols of libficco_ffi: the XLA FFI handlers of the copy-engine
// transports (rendezvous: docs/protocol.md; window and push:
// docs/windows.md) and a small C API for diagnostics and tests, loaded from
// Python with ctypes (ficco_jax/_src/dma/library.py).

#ifndef FICCO_XLA_FFI_FICCO_FFI_H_
#define FICCO_XLA_FFI_FICCO_FFI_H_

#include <cstdint>

#include "xla/ffi/api/api.h"

// CPU twin (cpu_peer_copy.cc, cpu_window.cc): worker threads and memcpy.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPeerCopyStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPeerCopySyncCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoFlagsArmCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoWindowStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoWindowWaitCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoWindowDoneCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPushArmCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPushStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPushFinishCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPushGatherCpu);
// Test hook (late_landing.h, cpu_late_landing.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoTestLateLandingCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoTestLateLandingJoinCpu);

#ifdef FICCO_WITH_CUDA
// CUDA (cuda_peer_copy.cu, cuda_window.cu): cudaMemcpyAsync on side
// streams.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPeerCopyStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPeerCopySyncCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoFlagsArmCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoWindowStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoWindowWaitCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoWindowDoneCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPushArmCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPushStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPushFinishCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPushGatherCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoTestLateLandingCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoTestLateLandingJoinCuda);
#endif

// Platforms of the diagnostics below.
enum FiccoPlatform { kFiccoCpu = 0, kFiccoCuda = 1 };

extern "C" {

// 1 if the CUDA handlers were compiled into this library.
int FiccoCudaCompiled(void);

// Invocations alive (started and not yet released by every rank's done), or
// -1 if the platform is not compiled in.
int64_t FiccoLiveInvocations(int platform);

// Registry entries (rendezvous, pending waits and dones), or -1.
int64_t FiccoPendingEntries(int platform);

// Events of `device` ever created and now back in its pool. Returns 0, or -1
// if the platform is not compiled in.
int FiccoEventCounts(int platform, int device, int64_t* created,
                     int64_t* pooled);

// Host time spent in the peer-copy handlers since the last reset, for one
// section `stat` (0 start, 1 of which waiting for peers, 2 of which issuing
// copies, 3 sync, 4 of which enqueueing compute-stream waits; for 4, `calls`
// counts the waits): summed over devices, in nanoseconds. Returns 0, or -1
// if the platform is not compiled in or `stat` is out of range.
int FiccoHostStats(int platform, int stat, int64_t* calls, int64_t* ns);
void FiccoHostStatsReset(int platform);

// Who issues the copies of later starts (issuer.h: 0 the last rank to
// arrive, 1 each rank in its start after a rendezvous, 2 each device's
// issuer thread): returns the previous mode, or -1 if the platform is not
// compiled in or does not support `mode` (the CPU twin: 0 or 2). Change it
// only while no op is in flight.
int FiccoSetIssueMode(int platform, int mode);
int FiccoIssueMode(int platform);

// Host timeline of the rendezvous handlers (host_trace.h), for diagnosis,
// compiled in only with the FICCO_TRACE build option (FiccoTraceCompiled
// says whether). Enable starts a trace of at most `capacity` events
// (dropping the previous one) and returns 0, -1 if it cannot allocate them,
// or -2 if tracing is not compiled in;
// Read copies up to `max_events` kept events, 4 int64 each (steady-clock ns,
// device, point + cpu * 65536, tag: the call site, or -1), returns how many it
// copied, and sets `*recorded` to how many were recorded (more than the
// capacity if the trace overflowed); Mark records
// point 8 with `device` and `tag` from the caller's thread. Enable and
// Disable only while no op is in flight, and Read after the ops finished.
int FiccoTraceCompiled(void);
int FiccoTraceEnable(int64_t capacity);
void FiccoTraceDisable(void);
int64_t FiccoTraceRead(int64_t* out, int64_t max_events, int64_t* recorded);
void FiccoTraceMark(int device, int64_t tag);
// GPU stamps (gpu_trace.h) into the same timeline, CUDA only: Enable
// preallocates `per_device` timing events per device and returns 0, or -1
// (not compiled in, or a CUDA error); FiccoTraceDisable stops them too.
// Times writes the GPU time in ns of each of `device`'s stamps relative to
// its first (the stamp events' tags index it) and returns how many, or -1.
int FiccoTraceGpuEnable(int64_t per_device);
int64_t FiccoTraceGpuTimes(int device, int64_t* out, int64_t max);

// Test hook: every start on `device` fails at once without joining its
// peers, which then run into their timeout. -1 (or the clear call) disables.
void FiccoTestSetNeverArrive(int device);
// step: 1 start (rendezvous/window start, push arm), 2 wait (window wait,
// push start), 3 done (window done, push finish).
void FiccoTestSetFault(int device, int step);
void FiccoTestClearFaults(void);

// --- The window transport (docs/windows.md), driven from Python at
// lowering. ---
// Every call returns 0, or 1 with a message in `error` (NUL-terminated).

// Creates `device`'s window of `family` for `rank` of `size` (`group_ids`:
// the global device id of each rank, for messages) with a slot of
// `slot_bytes`; writes a handle that other processes can map (at most
// *handle_len bytes; *handle_len becomes its length).
int FiccoWindowCreate(int platform, int64_t family, int device, int64_t rank,
                      int64_t size, const int64_t* group_ids,
                      int64_t slot_bytes, char* handle,
                      int64_t* handle_len, char* error, int64_t error_len);

// Maps rank `peer`'s window into `device`'s: from this process when
// `peer_device` >= 0 (its local ordinal), else from `handle`.
int FiccoWindowMap(int platform, int64_t family, int device, int64_t peer,
                   int peer_device, const char* handle, int64_t handle_len,
                   char* error, int64_t error_len);

// The window's handle goes to another process: its device memory stays
// (CUDA) when the family is freed, as for a window that maps a remote peer.
void FiccoWindowExported(int platform, int64_t family, int device);

// Every peer has mapped this window, and every window of its family in this
// process exists: count them (Window::local) and drop its shared-memory
// name.
void FiccoWindowSealed(int platform, int64_t family, int device);

// Starts so far on the window (-1: none), whether a failure poisoned it or
// a peer's window of its family, in this process or another (1, 0, or -1:
// none), windows whose memory is held (in use, retired and
// not yet reaped, or reaped with device memory another process maps), and
// wait/done entries pending.
int64_t FiccoWindowEpoch(int platform, int64_t family, int device);
int FiccoWindowPoisoned(int platform, int64_t family, int device);
int64_t FiccoWindowCount(int platform);
int64_t FiccoWindowPending(int platform);

// How often a window or push handler found another thread's handler of its
// window on its device still enqueueing, and waited for it: usually,
// programs that share windows are being dispatched from several threads
// (docs/protocol.md, "Several dispatching threads").
int64_t FiccoWindowIssueWaits(int platform);

// The family is abandoned (a failure replaced its pool): drop the push
// protocol's arm/start entries its failed execution left behind.
void FiccoWindowForget(int platform, int64_t family);

// Lowering replaced the family (a failure poisoned it): forget its push
// entries, poison and remove its windows in this process, with `why` for
// any call that still names it (Windows::Retire).
void FiccoWindowRetire(int platform, int64_t family, const char* why);

// Frees the retired families nothing holds any more; returns the number of
// windows whose memory it freed.
int64_t FiccoWindowReap(int platform);

}  // extern "C"

// Per-platform halves of the diagnostics, defined next to their backends.
namespace ficco {
int64_t CpuLiveInvocations();
int64_t CpuPendingEntries();
void CpuEventCounts(int device, int64_t* created, int64_t* pooled);
bool CpuHostStat(int stat, int64_t* calls, int64_t* ns);
void CpuHostStatsReset();
int CpuSetIssueMode(int mode);
int CpuIssueMode();
#ifdef FICCO_WITH_CUDA
int64_t CudaLiveInvocations();
int64_t CudaPendingEntries();
void CudaEventCounts(int device, int64_t* created, int64_t* pooled);
bool CudaHostStat(int stat, int64_t* calls, int64_t* ns);
void CudaHostStatsReset();
int CudaSetIssueMode(int mode);
int CudaIssueMode();
#ifdef FICCO_WITH_TRACE
bool CudaTraceGpuEnable(int64_t per_device);
void CudaTraceGpuDisable();
int64_t CudaTraceGpuTimes(int device, int64_t* out, int64_t max);
#endif
#endif
}  // namespace ficco

#endif  // FICCO_XLA_FFI_FICCO_FFI_H_
