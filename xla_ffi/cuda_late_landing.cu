// The late-landing test hook on CUDA (late_landing.h): the pieces land on a
// side stream, after a host-side delay, each followed by its flag.

#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <thread>

#include "attrs.h"
#include "cuda_util.h"
#include "ficco_ffi.h"
#include "late_landing.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {
namespace {

// Apart from every stream of the transports (window queues at 2^32 + q,
// the rendezvous flag stream at 2^40).
constexpr int64_t kLateLandingQueue = int64_t{1} << 41;

// Per device, the event after the last landing's last flag: the join makes
// the compute stream wait for it.
cudaEvent_t* LastLanding(int32_t device) {
  static std::mutex* mu = new std::mutex();
  static auto* events = new std::map<int32_t, cudaEvent_t>();
  std::lock_guard<std::mutex> lock(*mu);
  auto it = events->find(device);
  if (it == events->end()) {
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
      return nullptr;
    }
    it = events->emplace(device, e).first;
  }
  return &it->second;
}

void CUDART_CB Sleep(void* ms) {
  std::this_thread::sleep_for(
      std::chrono::milliseconds(reinterpret_cast<intptr_t>(ms)));
}

ffi::Error LateLandingImpl(cudaStream_t stream, int32_t device,
                           ffi::AnyBuffer src,
                           ffi::Result<ffi::AnyBuffer> landing,
                           ffi::Result<ffi::AnyBuffer> flags,
                           ffi::Result<ffi::AnyBuffer> src_out, Attrs attrs) {
  if (src.untyped_data() != src_out->untyped_data()) {
    return ffi::Error::Internal("ficco late-landing hook: src not aliased");
  }
  if (Ops().write == nullptr) return ffi::Error::Internal(Ops().error);
  auto l = CheckLateLanding(src, *landing, *flags, attrs);
  if (!l.has_value()) return l.error();
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  auto side = SideStream(device, kLateLandingQueue);
  if (!side.has_value()) return side.error();
  char* dst = static_cast<char*>(landing->untyped_data());
  auto* f = static_cast<char*>(flags->untyped_data());
  // Zeros first, on the compute stream: a kernel that read too early reads
  // zeros, not a stale result.
  FICCO_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(dst, 0, landing->size_bytes(), stream));
  FICCO_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(f, 0, flags->size_bytes(), stream));
  cudaEvent_t zeroed;
  FICCO_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&zeroed, cudaEventDisableTiming));
  FICCO_CUDA_RETURN_IF_ERROR(cudaEventRecord(zeroed, stream));
  FICCO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(*side, zeroed, 0));
  // Released once the wait has been enqueued (CUDA keeps it until done).
  FICCO_CUDA_RETURN_IF_ERROR(cudaEventDestroy(zeroed));
  FICCO_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(
      *side, Sleep, reinterpret_cast<void*>(intptr_t{attrs.timeout_ms})));
  const char* from = static_cast<const char*>(src.untyped_data());
  int64_t row = 0;
  for (int64_t i = 0; i < l->pieces; ++i) {
    const size_t bytes = static_cast<size_t>(attrs.rows[i] * l->row_bytes);
    FICCO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        dst + row * l->row_bytes, from + row * l->row_bytes, bytes,
        cudaMemcpyDeviceToDevice, *side));
    auto r = CheckCu(Ops().write(reinterpret_cast<CUstream>(*side),
                                 reinterpret_cast<CUdeviceptr>(f + 4 * i), 1, 0),
                     "cuStreamWriteValue32");
    if (r.failure()) return r;
    row += attrs.rows[i];
  }
  cudaEvent_t* last = LastLanding(device);
  if (last == nullptr) return ffi::Error::Internal("cudaEventCreate failed");
  FICCO_CUDA_RETURN_IF_ERROR(cudaEventRecord(*last, *side));
  return ffi::Error::Success();
}

ffi::Error JoinImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                    ffi::Result<ffi::AnyBuffer> out) {
  if (x.untyped_data() != out->untyped_data()) {
    return ffi::Error::Internal("ficco late-landing join: not aliased");
  }
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  cudaEvent_t* last = LastLanding(device);
  if (last == nullptr) return ffi::Error::Internal("cudaEventCreate failed");
  FICCO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, *last, 0));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ficco

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoTestLateLandingCuda, ficco::LateLandingImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .Arg<xla::ffi::AnyBuffer>()                     // src
        .Ret<xla::ffi::AnyBuffer>()                     // landing
        .Ret<xla::ffi::AnyBuffer>()                     // flags
        .Ret<xla::ffi::AnyBuffer>()                     // src, aliased
        .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoTestLateLandingJoinCuda, ficco::JoinImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .Arg<xla::ffi::AnyBuffer>()                     // x
        .Ret<xla::ffi::AnyBuffer>());                   // x, aliased
