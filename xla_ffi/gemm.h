// The GEMM of the push all-gather (gather_push_protocol.h): one peer's rows,
// read where they landed in this rank's window (memory outside XLA's
// buffers, which no XLA dot or Pallas kernel can take as an operand), times
// the local weight, written in place into the result's rows of that rank.
//
// Row-major throughout: c[m, n] = a[m, k] @ b[k, n], with a's and b's rows
// contiguous and c's rows `ldc` elements apart (a block of rows of the whole
// result). Accumulates in f32 (f64 for f64) and rounds once.

#ifndef FICCO_XLA_FFI_GEMM_H_
#define FICCO_XLA_FFI_GEMM_H_

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ficco {

namespace ffi = ::xla::ffi;

struct GemmArgs {
  ffi::DataType in;   // a's and b's element type
  ffi::DataType out;  // c's: `in`, or F32 for 16-bit inputs
  const char* a;
  const char* b;
  char* c;
  int64_t m, k, n, ldc;
};

// InvalidArgument unless (in, out) is one the GEMMs take: (F32, F32),
// (F64, F64), (BF16, BF16 or F32), (F16, F16 or F32).
ffi::Error CheckGemmTypes(ffi::DataType in, ffi::DataType out,
                          const std::string& who);

// The CPU twin: a plain loop (it is the protocol's twin, not a fast GEMM).
ffi::Error CpuGemm(const GemmArgs& g);
#ifdef FICCO_WITH_CUDA
// Enqueues the GEMM on `stream` (a cudaStream_t of `device`, current) with
// cuBLAS, the library XLA's own dots call; loaded at first use from the
// process (jaxlib's CUDA plugin has it loaded), so libficco_ffi has no link
// dependency on it.
ffi::Error CudaGemm(void* stream, int32_t device, const GemmArgs& g);
#endif

}  // namespace ficco

#endif  // FICCO_XLA_FFI_GEMM_H_
