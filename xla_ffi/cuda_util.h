// CUDA helpers shared by both CUDA transports (cuda_peer_copy.cu,
// cuda_window.cu): checked calls, the current device, persistent side
// streams and peer access.

#ifndef FICCO_XLA_FFI_CUDA_UTIL_H_
#define FICCO_XLA_FFI_CUDA_UTIL_H_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ficco {

namespace ffi = ::xla::ffi;

// Every CUDA call goes through Check, so a failure names the call.
inline ffi::Error Check(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(call) + " failed: " +
                              cudaGetErrorName(status) + " (" +
                              cudaGetErrorString(status) + ")");
}

#define FICCO_CUDA_RETURN_IF_ERROR(expr)                      \
  do {                                                        \
    if (::xla::ffi::Error _err = Check((expr), #expr);        \
        _err.failure()) {                                     \
      return _err;                                            \
    }                                                         \
  } while (0)

// Stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32)
// come from the driver API; cudart (linked statically) hands out the
// driver's entry points, so no -lcuda is needed.
using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t,
                                   unsigned int);

struct StreamOps {
  StreamValueFn write = nullptr;
  StreamValueFn wait = nullptr;
  std::string error;
};

// The driver's entry point `symbol` (CUDA 12.0 ABI) as a `Fn`, or nullptr.
template <class Fn>
Fn DriverEntryPoint(const char* symbol) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(symbol, &f, 12000, cudaEnableDefault,
                                       &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Fn>(f);
}

inline const StreamOps& Ops() {
  static StreamOps* ops = [] {
    auto* o = new StreamOps();
    o->write = DriverEntryPoint<StreamValueFn>("cuStreamWriteValue32");
    o->wait = DriverEntryPoint<StreamValueFn>("cuStreamWaitValue32");
    if (o->write == nullptr || o->wait == nullptr) {
      o->write = o->wait = nullptr;
      o->error = "the driver has no cuStreamWriteValue32/cuStreamWaitValue32";
    }
    return o;
  }();
  return *ops;
}

// cuStreamBatchMemOp: several flag waits and writes in one driver call (the
// push protocol's, push_protocol.h), in order, as the single calls would.
using BatchMemOpFn = CUresult (*)(CUstream, unsigned int,
                                  CUstreamBatchMemOpParams*, unsigned int);

inline BatchMemOpFn BatchMemOp() {
  static const BatchMemOpFn fn =
      DriverEntryPoint<BatchMemOpFn>("cuStreamBatchMemOp");
  return fn;
}

// cuMemsetD32Async, from the driver like the stream memory operations: the
// arm writes its int32 rank with it (cudaMemsetAsync sets bytes only).
using MemsetD32Fn = CUresult (*)(CUdeviceptr, unsigned int, size_t, CUstream);

inline MemsetD32Fn MemsetD32() {
  static const MemsetD32Fn fn =
      DriverEntryPoint<MemsetD32Fn>("cuMemsetD32Async");
  return fn;
}

inline ffi::Error CheckCu(CUresult r, const char* call) {
  if (r == CUDA_SUCCESS) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(call) + " failed: CUresult " +
                              std::to_string(static_cast<int>(r)));
}

// The flagged arms' compute-stream writes (both transports): zero the
// flags, and write the int32 rank (cudaMemsetAsync sets bytes only).
inline ffi::Error ZeroAsync(void* data, size_t bytes, cudaStream_t stream) {
  FICCO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(data, 0, bytes, stream));
  return ffi::Error::Success();
}

inline ffi::Error SetInt32Async(void* data, int32_t value,
                                cudaStream_t stream) {
  MemsetD32Fn memset32 = MemsetD32();
  if (memset32 == nullptr) {
    return ffi::Error::Internal("the driver has no cuMemsetD32Async");
  }
  return CheckCu(memset32(reinterpret_cast<CUdeviceptr>(data),
                          static_cast<unsigned int>(value), 1,
                          reinterpret_cast<CUstream>(stream)),
                 "cuMemsetD32Async");
}

// Makes `device` current for the handler's lifetime: events and streams are
// created on the current device, and XLA's thread may have another one set.
class ScopedDevice {
 public:
  // Every Side* call of a start sets its device; with parallel issue it is
  // already current (the handler set it), so most calls skip the set.
  ffi::Error Set(int device) {
    FICCO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous_));
    if (previous_ == device) return ffi::Error::Success();
    FICCO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    restore_ = true;
    return ffi::Error::Success();
  }
  ~ScopedDevice() {
    if (restore_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

// Side streams per (device, stream index), created once (with `device`
// current) and never destroyed: destroying them at exit could race the
// driver's own teardown.
inline ffi::ErrorOr<cudaStream_t> SideStream(int32_t device, int64_t index) {
  // A per-thread memo first: every copy of a start looks its queue up, and
  // the device threads would contend for the lock below.
  thread_local std::map<std::pair<int32_t, int64_t>, cudaStream_t> memo;
  if (auto it = memo.find({device, index}); it != memo.end()) return it->second;
  static std::mutex* mu = new std::mutex();
  static auto* streams = new std::map<std::pair<int32_t, int64_t>, cudaStream_t>();
  std::lock_guard<std::mutex> lock(*mu);
  auto it = streams->find({device, index});
  if (it != streams->end()) {
    memo.emplace(std::make_pair(device, index), it->second);
    return it->second;
  }
  cudaStream_t stream = nullptr;
  // Non-blocking: the side streams must not synchronize with the legacy
  // default stream.
  if (auto err = Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                       "cudaStreamCreateWithFlags(cudaStreamNonBlocking)");
      err.failure()) {
    return ffi::Unexpected(err);
  }
  streams->emplace(std::make_pair(device, index), stream);
  memo.emplace(std::make_pair(device, index), stream);
  return stream;
}

// Peer access, checked and enabled once per (receiving, source) pair.
inline ffi::Error EnablePeerAccess(int32_t device, int32_t peer) {
  static std::mutex* mu = new std::mutex();
  static auto* enabled = new std::map<std::pair<int32_t, int32_t>, bool>();
  if (device == peer) return ffi::Error::Success();
  std::lock_guard<std::mutex> lock(*mu);
  if ((*enabled)[{device, peer}]) return ffi::Error::Success();
  int can_access = 0;
  FICCO_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can_access, device, peer));
  if (!can_access) {
    // Without peer access a peer copy silently stages through host memory:
    // slow enough to defeat the overlap, so refuse instead.
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        "GPU " + std::to_string(device) + " cannot access the memory of GPU " +
            std::to_string(peer) +
            " (cudaDeviceCanAccessPeer = 0): comm='dma' needs peer access"
            " between every pair of devices on the axis; use"
            " Schedule(comm=\"xla\") on this machine");
  }
  // The caller made `device` current; enabling maps `peer`'s memory into it.
  cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
  if (status == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // XLA enabled it already; clear the sticky status.
  } else {
    FICCO_CUDA_RETURN_IF_ERROR(status);
  }
  (*enabled)[{device, peer}] = true;
  return ffi::Error::Success();
}

// A new pooled event (both transports keep per-device pools of these). No
// timing: cheaper records and waits.
inline ffi::ErrorOr<CUevent_st*> CreateEvent(int32_t) {
  cudaEvent_t event = nullptr;
  if (auto err = Check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                       "cudaEventCreateWithFlags(cudaEventDisableTiming)");
      err.failure()) {
    return ffi::Unexpected(err);
  }
  return event;
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_CUDA_UTIL_H_
