// CPU twin of the push all-gather's GEMM (gemm.h).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bf16.h"
#include "gemm.h"

namespace ficco {
namespace {

template <class T, class Acc, class Load, class Store>
void Loop(const GemmArgs& g, Load load, Store store) {
  const T* a = reinterpret_cast<const T*>(g.a);
  const T* b = reinterpret_cast<const T*>(g.b);
  std::vector<Acc> row(static_cast<size_t>(g.n));
  for (int64_t i = 0; i < g.m; ++i) {
    std::fill(row.begin(), row.end(), Acc{0});
    for (int64_t p = 0; p < g.k; ++p) {
      const Acc x = load(a[i * g.k + p]);
      const T* bp = b + p * g.n;
      for (int64_t j = 0; j < g.n; ++j) row[j] += x * load(bp[j]);
    }
    for (int64_t j = 0; j < g.n; ++j) store(g.c, i * g.ldc + j, row[j]);
  }
}

template <class O>
void StoreAs(char* c, int64_t i, float v);
template <>
void StoreAs<float>(char* c, int64_t i, float v) {
  reinterpret_cast<float*>(c)[i] = v;
}
template <>
void StoreAs<uint16_t>(char* c, int64_t i, float v) {
  reinterpret_cast<uint16_t*>(c)[i] = F32ToBf16(v);
}
template <>
void StoreAs<_Float16>(char* c, int64_t i, float v) {
  reinterpret_cast<_Float16*>(c)[i] = static_cast<_Float16>(v);
}

}  // namespace

ffi::Error CheckGemmTypes(ffi::DataType in, ffi::DataType out,
                          const std::string& who) {
  using T = ffi::DataType;
  const bool ok = (in == T::F32 && out == T::F32) ||
                  (in == T::F64 && out == T::F64) ||
                  ((in == T::BF16 || in == T::F16) && (out == in || out == T::F32));
  if (ok) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      who + ": element types (" + std::to_string(static_cast<int>(in)) +
      " in, " + std::to_string(static_cast<int>(out)) +
      " out) are not f32->f32, f64->f64, bf16->bf16|f32 or f16->f16|f32");
}

ffi::Error CpuGemm(const GemmArgs& g) {
  using T = ffi::DataType;
  if (ffi::Error err = CheckGemmTypes(g.in, g.out, "ficco gemm");
      err.failure()) {
    return err;
  }
  auto bf16 = [](uint16_t v) { return Bf16ToF32(v); };
  auto f16 = [](_Float16 v) { return static_cast<float>(v); };
  switch (g.in) {
    case T::F32:
      Loop<float, float>(g, [](float v) { return v; }, StoreAs<float>);
      break;
    case T::F64:
      Loop<double, double>(g, [](double v) { return v; },
                           [](char* c, int64_t i, double v) {
                             reinterpret_cast<double*>(c)[i] = v;
                           });
      break;
    case T::BF16:
      if (g.out == T::F32) {
        Loop<uint16_t, float>(g, bf16, StoreAs<float>);
      } else {
        Loop<uint16_t, float>(g, bf16, StoreAs<uint16_t>);
      }
      break;
    default:  // F16
      if (g.out == T::F32) {
        Loop<_Float16, float>(g, f16, StoreAs<float>);
      } else {
        Loop<_Float16, float>(g, f16, StoreAs<_Float16>);
      }
  }
  return ffi::Error::Success();
}

}  // namespace ficco
