// The push protocol's end (push_protocol.h): a rank's result is its own rows
// plus the pieces its peers pushed into its window. Out chunk c is own chunk
// c plus landing pieces c * peers .. c * peers + peers - 1, added in that
// order in f32 (f64 for f64) and rounded once, as the rendezvous path's XLA
// sum does (`_add_pulled` of the matmul reduce-scatter).

#ifndef FICCO_XLA_FFI_PUSH_SUM_H_
#define FICCO_XLA_FFI_PUSH_SUM_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ficco {

namespace ffi = ::xla::ffi;

struct PushSumArgs {
  ffi::DataType dtype;
  char* out;            // chunks * chunk_elems
  const char* own;      // chunks * chunk_elems
  const char* landing;  // chunks * peers * chunk_elems
  int64_t chunks, peers, chunk_elems;
};

// The error for a result type the sum does not handle.
ffi::Error UnsupportedSumType(ffi::DataType dtype);

// F32, BF16, F16 or F64; anything else is UnsupportedSumType.
ffi::Error CpuPushSum(const PushSumArgs& a);
#ifdef FICCO_WITH_CUDA
// Enqueues the sum on `stream` (a cudaStream_t), a kernel of this library.
ffi::Error CudaPushSum(void* stream, const PushSumArgs& a);
#endif

}  // namespace ficco

#endif  // FICCO_XLA_FFI_PUSH_SUM_H_
