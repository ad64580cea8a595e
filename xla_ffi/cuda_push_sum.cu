// CUDA sum of the push protocol (push_sum.h): one grid-stride kernel reading
// the own rows and the landed pieces 16 bytes at a time where alignment
// allows, accumulating in f32 (f64 for f64). It replaces the XLA fusion of
// the rendezvous path (one launch either way), reading the window directly.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda_util.h"
#include "push_sum.h"

namespace ficco {
namespace {

__device__ __forceinline__ float ToAcc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToAcc(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToAcc(float v) { return v; }
__device__ __forceinline__ double ToAcc(double v) { return v; }
template <class T> __device__ __forceinline__ T FromAcc(float v);
template <> __device__ __forceinline__ __nv_bfloat16 FromAcc(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half FromAcc(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ float FromAcc(float v) { return v; }
__device__ __forceinline__ double FromAccD(double v) { return v; }

template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Vector v of the result covers elements [v V, v V + V) of one chunk. With
// NP > 0 the op has exactly NP peers and every piece's load is issued before
// the first add (with a runtime trip count the loads go one after another,
// and the kernel is slower than XLA's fusion of the same sum: ~22 against
// ~19.5 us at square 4096 on 4xH200); NP = 0 takes `peers` at run time. The
// adds keep their order either way: own, then peers 0, 1, ...
template <class T, class Acc, int V, int NP>
__global__ void PushSumKernel(T* out, const T* own, const T* landing,
                              int64_t chunks, int64_t peers,
                              int64_t chunk_vecs) {
  using P = Pack<T, V>;
  const int64_t total = chunks * chunk_vecs;
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < total;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t c = v / chunk_vecs, off = v - c * chunk_vecs;
    const P a = reinterpret_cast<const P*>(own)[v];
    Acc acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = ToAcc(a.v[j]);
    if constexpr (NP > 0) {
      P b[NP];
#pragma unroll
      for (int k = 0; k < NP; ++k) {
        b[k] = reinterpret_cast<const P*>(landing)[(c * NP + k) * chunk_vecs + off];
      }
#pragma unroll
      for (int k = 0; k < NP; ++k) {
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += ToAcc(b[k].v[j]);
      }
    } else {
      for (int64_t k = 0; k < peers; ++k) {
        const P b = reinterpret_cast<const P*>(landing)[(c * peers + k) * chunk_vecs + off];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += ToAcc(b.v[j]);
      }
    }
    P r;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if constexpr (sizeof(Acc) == 8) {
        r.v[j] = FromAccD(acc[j]);
      } else {
        r.v[j] = FromAcc<T>(acc[j]);
      }
    }
    reinterpret_cast<P*>(out)[v] = r;
  }
}

// The kernel for this peer count: unrolled for the axes of 2, 4 and 8
// devices, the run-time loop otherwise.
template <class T, class Acc, int V>
void LaunchForPeers(cudaStream_t stream, int blocks, int threads, T* out,
                    const T* own, const T* landing, int64_t chunks,
                    int64_t peers, int64_t chunk_vecs) {
  switch (peers) {
    case 1:
      PushSumKernel<T, Acc, V, 1><<<blocks, threads, 0, stream>>>(
          out, own, landing, chunks, peers, chunk_vecs);
      break;
    case 3:
      PushSumKernel<T, Acc, V, 3><<<blocks, threads, 0, stream>>>(
          out, own, landing, chunks, peers, chunk_vecs);
      break;
    case 7:
      PushSumKernel<T, Acc, V, 7><<<blocks, threads, 0, stream>>>(
          out, own, landing, chunks, peers, chunk_vecs);
      break;
    default:
      PushSumKernel<T, Acc, V, 0><<<blocks, threads, 0, stream>>>(
          out, own, landing, chunks, peers, chunk_vecs);
  }
}

template <class T, class Acc>
ffi::Error Launch(cudaStream_t stream, const PushSumArgs& a) {
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned =
      a.chunk_elems % kVec == 0 &&
      (reinterpret_cast<uintptr_t>(a.out) | reinterpret_cast<uintptr_t>(a.own) |
       reinterpret_cast<uintptr_t>(a.landing)) % 16 == 0;
  const int vec = aligned ? kVec : 1;
  const int64_t chunk_vecs = a.chunk_elems / vec;
  const int64_t total = a.chunks * chunk_vecs;
  if (total == 0) return ffi::Error::Success();
  constexpr int kThreads = 256;
  // Enough blocks to fill an H200 several times over; the loop strides.
  const int blocks = static_cast<int>(
      std::min<int64_t>((total + kThreads - 1) / kThreads, 132 * 16));
  T* out = reinterpret_cast<T*>(a.out);
  const T* own = reinterpret_cast<const T*>(a.own);
  const T* landing = reinterpret_cast<const T*>(a.landing);
  if (aligned) {
    LaunchForPeers<T, Acc, kVec>(stream, blocks, kThreads, out, own, landing,
                                 a.chunks, a.peers, chunk_vecs);
  } else {
    LaunchForPeers<T, Acc, 1>(stream, blocks, kThreads, out, own, landing,
                              a.chunks, a.peers, chunk_vecs);
  }
  FICCO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace

ffi::Error CudaPushSum(void* stream, const PushSumArgs& a) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case ffi::DataType::F32: return Launch<float, float>(s, a);
    case ffi::DataType::F64: return Launch<double, double>(s, a);
    case ffi::DataType::BF16: return Launch<__nv_bfloat16, float>(s, a);
    case ffi::DataType::F16: return Launch<__half, float>(s, a);
    default:
      return UnsupportedSumType(a.dtype);
  }
}

}  // namespace ficco
