// Environment knobs read once by the handlers (for measurements).

#ifndef FICCO_XLA_FFI_ENV_H_
#define FICCO_XLA_FFI_ENV_H_

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ficco {

// Microseconds from environment variable `var`, or `fallback` if it is unset;
// a value that is not a non-negative integer is logged and `fallback` used.
inline std::chrono::microseconds MicrosFromEnv(const char* var,
                                               long long fallback) {
  const char* v = std::getenv(var);
  if (v == nullptr || *v == '\0') return std::chrono::microseconds(fallback);
  char* end = nullptr;
  const long long us = std::strtoll(v, &end, 10);
  if (*end != '\0' || us < 0) {
    std::fprintf(stderr, "ficco: %s=%s is not a number of microseconds;"
                 " using %lld\n", var, v, fallback);
    return std::chrono::microseconds(fallback);
  }
  return std::chrono::microseconds(us);
}

// Whether environment variable `var` is set to exactly `value` (the
// measurement switches: FICCO_CUDA_MEMCPY=peer, FICCO_FLAG_STREAMS=piece).
inline bool EnvIs(const char* var, const char* value) {
  const char* v = std::getenv(var);
  return v != nullptr && std::strcmp(v, value) == 0;
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_ENV_H_
