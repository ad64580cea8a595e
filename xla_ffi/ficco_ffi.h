// Public symbols of libficco_ffi: the XLA FFI handlers of the peer-copy
// protocol (PROTOCOL.md) and a small C API for diagnostics and tests, loaded
// from Python with ctypes (ficco_jax/_src/dma/library.py).

#ifndef FICCO_XLA_FFI_FICCO_FFI_H_
#define FICCO_XLA_FFI_FICCO_FFI_H_

#include <cstdint>

#include "xla/ffi/api/api.h"

// CPU twin (cpu_peer_copy.cc): worker threads and memcpy.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPeerCopyStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPeerCopyWaitCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPeerCopyDoneCpu);

#ifdef FICCO_WITH_CUDA
// CUDA (cuda_peer_copy.cu): cudaMemcpyPeerAsync on side streams.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPeerCopyStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPeerCopyWaitCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FiccoPeerCopyDoneCuda);
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

// Test hook: every start on `device` fails at once without joining its
// peers, which then run into their timeout. -1 (or the clear call) disables.
void FiccoTestSetNeverArrive(int device);
void FiccoTestClearNeverArrive(void);

}  // extern "C"

// Per-platform halves of the diagnostics, defined next to their backends.
namespace ficco {
int64_t CpuLiveInvocations();
int64_t CpuPendingEntries();
void CpuEventCounts(int device, int64_t* created, int64_t* pooled);
#ifdef FICCO_WITH_CUDA
int64_t CudaLiveInvocations();
int64_t CudaPendingEntries();
void CudaEventCounts(int device, int64_t* created, int64_t* pooled);
#endif
}  // namespace ficco

#endif  // FICCO_XLA_FFI_FICCO_FFI_H_
