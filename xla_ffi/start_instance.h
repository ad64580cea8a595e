// Which start instruction of an executable a call runs, on XLA:CPU.
//
// The transports pair the devices' invocations of one call site by order:
// the k-th start of a site in an execution (the rendezvous's seq), or the
// e-th start on a window (its epoch). One traced site can run twice in one
// execution (a jitted function holding the op called twice, or
// jax.checkpoint's recomputation): XLA inlines the traced function, and the
// two starts are two instructions with equal attributes. A GPU runs an
// executable's instructions in one order on every device, so the orders
// agree; XLA:CPU runs independent instructions in whatever order they
// become ready, so two devices may run the two in opposite orders, and
// pairing by order would mix their data (docs/protocol.md, "Several runs of
// one site").
//
// XLA's instantiate stage makes one state object per instruction of an
// executable, and XLA:CPU runs one executable's instructions for all its
// devices, so the object's address names the instruction on every device of
// the process: the rendezvous pairs by it, and a window start checks that
// the peers in this process ran the same instruction at its epoch
// (epoch_runs.h). CUDA handlers pass 0 (no state): their order is the
// program's.

#ifndef FICCO_XLA_FFI_START_INSTANCE_H_
#define FICCO_XLA_FFI_START_INSTANCE_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ficco {

namespace ffi = ::xla::ffi;

struct StartInstance {
  static ffi::TypeId id;  // Set when jax registers the type.
};

// The instruction's identity: nonzero, equal on the devices that run it.
inline int64_t InstanceId(const StartInstance* s) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(s));
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_START_INSTANCE_H_
