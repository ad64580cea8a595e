// The CPU twin's backend (the concept: backend.h): copy queues are the
// twin's worker threads (cpu_runtime.h), events are flags with condition
// variables, copies are memcpy, and flags are atomics. The handler's own
// thread is the compute stream: XLA:CPU runs a handler once its operands
// are complete.
//
// The queue operations of the rendezvous transport are defined in
// cpu_peer_copy.cc (a queue blocks on an event like a stream, bounded by the
// op's timeout), those of the window and push transports in cpu_window.cc
// (per-window lanes whose waits yield the queue; see Lane there).

#ifndef FICCO_XLA_FFI_CPU_BACKEND_H_
#define FICCO_XLA_FFI_CPU_BACKEND_H_

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"
#include "cpu_runtime.h"
#include "event_pool.h"
#include "ficco_ffi.h"
#include "gemm.h"
#include "issuer.h"
#include "peer_copy_registry.h"  // Clock
#include "xla/ffi/api/ffi.h"

namespace ficco {

namespace ffi = ::xla::ffi;

// Both transports' events, per device.
inline EventPools<CpuEvent>& CpuEventPools() {
  static auto* pools = new EventPools<CpuEvent>();
  return *pools;
}

struct CpuBackend {
  using Event = CpuEvent;
  using Inv = Invocation<CpuBackend>;              // rendezvous
  using WindowInv = WindowInvocation<CpuBackend>;  // window and push

  static constexpr int kPlatform = kFiccoCpu;
  // The kernel's results are complete before a handler runs: any copy of
  // the flags XLA made holds their final counts.
  static constexpr bool kFlagsMustAlias = false;
  // Queues are threads: a flag wait blocks only its own queue, so the host
  // need not order waits after writes (and XLA:CPU's small handler pool
  // must not block in start).
  static constexpr bool kHostOrdered = false;
  // Worker threads share no SMs with the compute: the stage need not run
  // first.
  static constexpr bool kStageBeforeCompute = false;
  // The push protocol's "compute stream" is a queue thread of its own.
  static constexpr int64_t kComputeQueue = kPushQueue + 1;
  // The window's header is host memory: any timeout can name who is late.
  static constexpr bool kNamesWaits = true;
  // The rendezvous flag waits' queue; copy queues are [0, num_streams), the
  // completer -1.
  static constexpr int64_t kFlagQueue = int64_t{1} << 40;

  // XLA:CPU runs handlers on a small shared pool: a start that blocked for
  // its peers could starve them, so by default the last rank to arrive
  // issues for all; the C API (FiccoSetIssueMode) can select async issue,
  // where each device's issuer thread, which is ficco's own, waits and
  // issues instead. Never parallel.
  static bool SupportsIssueMode(int mode) {
    return mode == kIssueLast || mode == kIssueAsync;
  }
  static int DefaultIssueMode() { return kIssueLast; }
  // The issuer threads hold no per-thread device state.
  static void BindIssuer(int32_t) {}

  static ffi::ErrorOr<Event*> AcquireEvent(int32_t device) {
    return AcquireCpuEvent(CpuEventPools(), device);
  }
  static void ReleaseEvent(int32_t device, Event* e) {
    CpuEventPools().Release(device, e);
  }

  // The handler's thread is the compute stream, and it runs once its
  // operands are complete.
  ffi::Error RecordOnCompute(int32_t, Event* e) {
    e->Set(CpuEvent::kOk);
    return ffi::Error::Success();
  }
  void DrainWait(Event* e, Clock::time_point deadline) {
    e->WaitUntil(deadline);
  }
  ffi::Error ZeroOnCompute(void* data, size_t bytes) {
    std::memset(data, 0, bytes);
    return ffi::Error::Success();
  }
  ffi::Error SetInt32OnCompute(void* data, int32_t value) {
    std::memcpy(data, &value, sizeof(value));
    return ffi::Error::Success();
  }
  ffi::Error EnsurePeerAccess(int32_t, int32_t) {
    return ffi::Error::Success();
  }

  // Queues of the rendezvous transport (cpu_peer_copy.cc).
  FICCO_BACKEND_QUEUE_OPS(Inv)
  FICCO_BACKEND_FLAG_READY

  // Queues of the window and push transports (cpu_window.cc).
  FICCO_BACKEND_QUEUE_OPS(WindowInv)
  FICCO_BACKEND_WINDOW_OPS(WindowInv)
  // Host work in queue order, for what a host-ordered backend does on the
  // host before it enqueues (push_ident.h): this host does not order the
  // peers, its lanes do.
  ffi::Error InLane(const std::shared_ptr<WindowInv>& inv, int32_t device,
                    int64_t queue, std::function<void()> op);
  // A lane wait until `over()`, bounded like WaitFlag's, whose timeout
  // names `who`.
  ffi::Error WaitUntil(const std::shared_ptr<WindowInv>& inv, int32_t device,
                       int64_t queue, std::function<bool()> over,
                       const std::string& who);
};

}  // namespace ficco

#endif  // FICCO_XLA_FFI_CPU_BACKEND_H_
