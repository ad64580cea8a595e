// What a device does when its execution fails in a rendezvous handler
// (docs/protocol.md, "Failure and timeouts"): it drops what it registered
// in that execution, and lets the copies into its landing buffers and out
// of its buffers end first. XLA frees an execution's buffers once its
// error surfaces; a copy still under way would then write freed memory
// (the CPU twin's heap) or memory XLA has handed to the next program.
//
// Besides the Registry's and the protocol's requirements, a Backend
// instance provides
//   DrainWait(event, deadline)   what follows on the compute stream comes
//                                after `event` (CPU: a bounded host wait)

#ifndef FICCO_XLA_FFI_PEER_COPY_DRAIN_H_
#define FICCO_XLA_FFI_PEER_COPY_DRAIN_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "peer_copy_protocol.h"
#include "peer_copy_registry.h"

namespace ficco {

// One registration of the failed execution. Copies are issued only once
// every rank arrived: an invocation still missing a rank is abandoned
// (none of its copies will run; the peers fail at once, naming `cause`).
// Otherwise the issue is under way on another thread, which never waits
// for XLA, so this waits for it (bounded), then for the part's events: the
// arrivals into its landing buffer (wait), or the peers' copies that read
// its buffers (done).
template <class Backend>
void DrainPart(Backend& backend, int32_t device,
               const typename Registry<Backend>::Dropped& d,
               const std::string& cause) {
  auto& inv = *d.inv;
  const Plan& plan = *inv.plan;
  const bool is_wait = d.landing >= 0;
  const std::string where =
      Where(is_wait ? "wait" : "done", plan, device,
            Position{inv.key.group, d.rank});
  const std::string message = where + ": " + cause;
  std::unique_lock<std::mutex> lock(inv.mu);
  const bool arrived = inv.arrived == plan.axis_size;
  if (!arrived) {
    // Under the lock that arrivals take, so no rank becomes the last after
    // this; and with the failure that late arrivers report.
    inv.abandoned = true;
    inv.FailLocked(message);
  }
  lock.unlock();
  if (arrived) {
    SpinThenWait(lock, inv.cv, DeadlineAfter(plan.timeout_ms),
                 [&] { return inv.issued.load() || inv.failed(); });
    lock.unlock();
  }
  if (!inv.issued) {
    Abandon(d.inv, d.rank, device, message);
    return;
  }
  // A queue may wait up to the timeout for a peer before a copy; then its
  // events read failed, so every one of them is set by twice that.
  const auto deadline = DeadlineAfter(2 * plan.timeout_ms);
  for (const auto& e : is_wait ? LandingEvents(inv, d.rank, d.landing)
                               : ReaderEvents(inv, d.rank)) {
    backend.DrainWait(e.event, deadline);
  }
  if (!is_wait) MarkLeft(inv, d.rank);
}

// `device`'s part of execution `run_id` failed with `cause`: every wait and
// done it still had registered is dropped and drained (DrainPart), so the
// failure may surface. For handlers that may block briefly: a CUDA handler,
// or a CPU handler on XLA's thread (it waits only for ficco's threads).
template <class Backend>
void DrainFailedRun(Backend& backend, int64_t run_id, int32_t device,
                    const std::string& cause) {
  auto& registry = Registry<Backend>::Get();
  registry.NoteFailure(device, run_id, cause);
  for (const auto& d : registry.DropRun(device, run_id)) {
    DrainPart(backend, device, d, cause);
  }
}

// A sync part that found nothing registered (`miss`) on a device whose part
// of the execution already failed: XLA:CPU runs a program's independent
// custom calls at once, so one sync may fail and drop its execution's
// registrations while another is under way. That failure is the one to
// report, not a misuse.
template <class Backend>
ffi::Error ExplainMiss(int64_t run_id, int32_t device, ffi::Error miss) {
  auto why = Registry<Backend>::Get().RunFailure(device, run_id);
  if (!why.has_value()) return miss;
  return ffi::Error(ffi::ErrorCode::kAborted,
                    "ficco peer copy sync on device " + std::to_string(device) +
                        ": not run: this device's part of the execution"
                        " already failed in another copy-engine op" +
                        (why->empty() ? "" : ": " + *why));
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_PEER_COPY_DRAIN_H_
