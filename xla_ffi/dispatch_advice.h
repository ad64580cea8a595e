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
    " them from one thread, or hold one lock around each call (XLA:CPU"
    " does so from one thread too when programs over different, overlapping"
    " sets of devices are called without waiting: block on a result before"
    " calling a program over another set)";

// Why a push start or arm finds its site's previous call unfinished in the
// same execution, and what to do (docs/protocol.md, "Several runs of one
// site").
inline constexpr const char* kRunsTwice =
    "one traced call site runs twice at once in this execution (a jitted"
    " function holding the op, called twice in one program, or"
    " jax.checkpoint's recomputation under jax.grad), and the push transport"
    " runs a site's calls one at a time: trace each call on its own (call"
    " the op outside the jitted function), or in one process use"
    " transport='rendezvous'; then call jax.clear_caches(), since this"
    " window's ranks no longer agree on epochs";

// Why a push start finds the previous start of its window on its device
// without its finish, and what to do.
inline const std::string kStartUnfinished =
    std::string("an execution failed between them, another host thread's"
                " program runs between them on this device (") +
    kIfSeveralDispatchers + "), or " + kRunsTwice;

// jax.clear_caches() re-lowers jitted programs onto fresh windows; one
// compiled ahead of time keeps its windows until compiled again. A macro,
// so that messages can splice it into string literals.
#define FICCO_AOT_ADVICE                                                \
  "a program compiled ahead of time, with .lower().compile(), must be" \
  " lowered and compiled again"

// What to do after a window or push timeout: it poisons the window, so
// the next call fails until the program is lowered onto fresh windows.
inline constexpr const char* kAfterWindowTimeout =
    ". The ranks of this window no longer agree on epochs: call"
    " jax.clear_caches() before calling again (" FICCO_AOT_ADVICE ")";

// The tail of a window or push timeout: the ranks that never signalled
// (e.g. "rank 1 (device 1)"), why that may be, and what to do next.
inline std::string NeverSignalled(const std::string& ranks) {
  return "never signalled: " + ranks +
         "; a rank that never reaches this op stalls the others, and " +
         kIfSeveralDispatchers + kAfterWindowTimeout;
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_DISPATCH_ADVICE_H_
