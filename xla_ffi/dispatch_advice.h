// What to do when several host threads dispatch programs that share
// devices, in every message about a failure that may come from it
// (docs/protocol.md, "Several dispatching threads").

#ifndef FICCO_XLA_FFI_DISPATCH_ADVICE_H_
#define FICCO_XLA_FFI_DISPATCH_ADVICE_H_

#include <string>

namespace ficco {

inline constexpr const char* kIfSeveralDispatchers =
    "if several host threads dispatch programs that share these devices,"
    " XLA may run them in different orders on different devices: dispatch"
    " them from one thread, or hold one lock around each call";

// The tail of a window or push timeout: the ranks that never signalled
// (e.g. "rank 1 (device 1)"), and why that may be.
inline std::string NeverSignalled(const std::string& ranks) {
  return "never signalled: " + ranks +
         "; a rank that never reaches this op stalls the others, and " +
         kIfSeveralDispatchers;
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_DISPATCH_ADVICE_H_
