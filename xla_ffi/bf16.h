// bfloat16 <-> float32 on the host, as XLA converts (the CPU twins' sums and
// GEMMs).

#ifndef FICCO_XLA_FFI_BF16_H_
#define FICCO_XLA_FFI_BF16_H_

#include <cstdint>
#include <cstring>

namespace ficco {

inline float Bf16ToF32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaNs stay quiet NaNs.
inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_BF16_H_
