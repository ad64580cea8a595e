// CUDA GEMM of the push all-gather (gemm.h): cuBLAS, the library XLA's own
// dots call, on XLA's compute stream. cuBLAS is found in the process at
// first use (jaxlib's CUDA plugin loads it), so this library neither links
// it nor needs its headers (a CUDA toolkit without the math libraries
// builds it): the few declarations below are cuBLAS's stable C ABI.

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <library_types.h>  // cudaDataType

#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <string>

#include "cuda_util.h"
#include "gemm.h"

namespace ficco {
namespace {

// From cublas_api.h (CUDA 12 and 13).
struct cublasContext;
using cublasHandle_t = cublasContext*;
using cublasStatus_t = int;
constexpr cublasStatus_t CUBLAS_STATUS_SUCCESS = 0;
using cublasOperation_t = int;
constexpr cublasOperation_t CUBLAS_OP_N = 0;
using cublasComputeType_t = int;
constexpr cublasComputeType_t CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_64F = 70;
using cublasGemmAlgo_t = int;
constexpr cublasGemmAlgo_t CUBLAS_GEMM_DEFAULT = -1;

struct Cublas {
  cublasStatus_t (*create)(cublasHandle_t*) = nullptr;
  cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t) = nullptr;
  cublasStatus_t (*set_workspace)(cublasHandle_t, void*, size_t) = nullptr;
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t,
                            cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*,
                            cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t,
                            cublasGemmAlgo_t) = nullptr;
  std::string error;
};

const Cublas& Lib() {
  static const Cublas* lib = [] {
    auto* c = new Cublas();
    void* h = nullptr;
    // The copy already in the process first (jaxlib's), so both use one.
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
      h = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
      if (h != nullptr) break;
    }
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
      if (h != nullptr) break;
      h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    }
    if (h == nullptr) {
      c->error = "cuBLAS (libcublas.so.13 or .12) is not loadable in this process";
      return c;
    }
    c->create = reinterpret_cast<decltype(c->create)>(dlsym(h, "cublasCreate_v2"));
    c->set_stream = reinterpret_cast<decltype(c->set_stream)>(dlsym(h, "cublasSetStream_v2"));
    c->set_workspace = reinterpret_cast<decltype(c->set_workspace)>(dlsym(h, "cublasSetWorkspace_v2"));
    c->gemm_ex = reinterpret_cast<decltype(c->gemm_ex)>(dlsym(h, "cublasGemmEx"));
    if (!c->create || !c->set_stream || !c->set_workspace || !c->gemm_ex) {
      c->create = nullptr;
      c->error = "the loaded cuBLAS lacks cublasCreate_v2, cublasSetStream_v2,"
                 " cublasSetWorkspace_v2 or cublasGemmEx";
    }
    return c;
  }();
  return *lib;
}

ffi::Error CheckBlas(cublasStatus_t s, const char* call) {
  if (s == CUBLAS_STATUS_SUCCESS) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(call) + " failed: cublasStatus_t " +
                              std::to_string(static_cast<int>(s)));
}

// One handle per device, with its own workspace (so cuBLAS never allocates
// during a call), created with the device current and kept for the process.
// The lock covers set-stream-then-enqueue: a handle is not safe to share
// across threads otherwise.
struct DeviceBlas {
  std::mutex mu;
  cublasHandle_t handle = nullptr;
};

ffi::ErrorOr<DeviceBlas*> ForDevice(int32_t device) {
  static std::mutex* mu = new std::mutex();
  static auto* handles = new std::map<int32_t, DeviceBlas*>();
  std::lock_guard<std::mutex> lock(*mu);
  if (auto it = handles->find(device); it != handles->end()) return it->second;
  const Cublas& lib = Lib();
  if (lib.create == nullptr) return ffi::Unexpected(ffi::Error::Internal(lib.error));
  auto* d = new DeviceBlas();
  if (auto err = CheckBlas(lib.create(&d->handle), "cublasCreate"); err.failure()) {
    delete d;
    return ffi::Unexpected(err);
  }
  constexpr size_t kWorkspace = size_t{32} << 20;  // cuBLAS's advice on Hopper
  void* ws = nullptr;
  if (auto err = Check(cudaMalloc(&ws, kWorkspace), "cudaMalloc(cuBLAS workspace)");
      err.failure()) {
    return ffi::Unexpected(err);
  }
  if (auto err = CheckBlas(lib.set_workspace(d->handle, ws, kWorkspace),
                           "cublasSetWorkspace");
      err.failure()) {
    return ffi::Unexpected(err);
  }
  handles->emplace(device, d);
  return d;
}

cudaDataType CudaType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F64: return CUDA_R_64F;
    case ffi::DataType::BF16: return CUDA_R_16BF;
    case ffi::DataType::F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

}  // namespace

ffi::Error CudaGemm(void* stream, int32_t device, const GemmArgs& g) {
  if (ffi::Error err = CheckGemmTypes(g.in, g.out, "ficco gemm");
      err.failure()) {
    return err;
  }
  if (g.m == 0 || g.n == 0) return ffi::Error::Success();
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (g.m > kMax || g.n > kMax || g.k > kMax || g.ldc > kMax) {
    return ffi::Error::InvalidArgument(
        "ficco gemm: a dimension exceeds cuBLAS's int range");
  }
  auto d = ForDevice(device);
  if (!d.has_value()) return d.error();
  const Cublas& lib = Lib();
  std::lock_guard<std::mutex> lock((*d)->mu);
  if (ffi::Error err = CheckBlas(
          lib.set_stream((*d)->handle, static_cast<cudaStream_t>(stream)),
          "cublasSetStream");
      err.failure()) {
    return err;
  }
  // Row-major c = a @ b is column-major c^T = b^T a^T: cuBLAS sees b as an
  // n x k matrix (leading dimension n) and a as k x m (leading dimension k).
  const bool f64 = g.in == ffi::DataType::F64;
  const float one_f = 1.0f, zero_f = 0.0f;
  const double one_d = 1.0, zero_d = 0.0;
  const void* alpha = f64 ? static_cast<const void*>(&one_d) : &one_f;
  const void* beta = f64 ? static_cast<const void*>(&zero_d) : &zero_f;
  return CheckBlas(
      lib.gemm_ex((*d)->handle, CUBLAS_OP_N, CUBLAS_OP_N,
                  static_cast<int>(g.n), static_cast<int>(g.m),
                  static_cast<int>(g.k), alpha, g.b, CudaType(g.in),
                  static_cast<int>(g.n), g.a, CudaType(g.in),
                  static_cast<int>(g.k), beta, g.c, CudaType(g.out),
                  static_cast<int>(g.ldc),
                  f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F,
                  CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

}  // namespace ficco
