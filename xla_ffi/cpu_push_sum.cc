// CPU twin of the push protocol's sum (push_sum.h).

#include <cstdint>
#include <cstring>
#include <string>

#include "bf16.h"
#include "push_sum.h"

namespace ficco {
namespace {

template <class T, class Acc, class Load, class Store>
void Sum(const PushSumArgs& a, Load load, Store store) {
  const T* own = reinterpret_cast<const T*>(a.own);
  const T* landing = reinterpret_cast<const T*>(a.landing);
  T* out = reinterpret_cast<T*>(a.out);
  for (int64_t c = 0; c < a.chunks; ++c) {
    for (int64_t x = 0; x < a.chunk_elems; ++x) {
      Acc acc = load(own[c * a.chunk_elems + x]);
      for (int64_t k = 0; k < a.peers; ++k) {
        acc += load(landing[(c * a.peers + k) * a.chunk_elems + x]);
      }
      out[c * a.chunk_elems + x] = store(acc);
    }
  }
}

}  // namespace

ffi::Error CpuPushSum(const PushSumArgs& a) {
  switch (a.dtype) {
    case ffi::DataType::F32:
      Sum<float, float>(a, [](float v) { return v; }, [](float v) { return v; });
      return ffi::Error::Success();
    case ffi::DataType::F64:
      Sum<double, double>(a, [](double v) { return v; },
                          [](double v) { return v; });
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      Sum<uint16_t, float>(a, Bf16ToF32, F32ToBf16);
      return ffi::Error::Success();
    case ffi::DataType::F16:
      Sum<_Float16, float>(a, [](_Float16 v) { return static_cast<float>(v); },
                           [](float v) { return static_cast<_Float16>(v); });
      return ffi::Error::Success();
    default:
      return UnsupportedSumType(a.dtype);
  }
}

ffi::Error UnsupportedSumType(ffi::DataType dtype) {
  return ffi::Error::InvalidArgument(
      "ficco push finish: the result's element type " +
      std::to_string(static_cast<int>(dtype)) +
      " is not f32, bf16, f16 or f64");
}

}  // namespace ficco
