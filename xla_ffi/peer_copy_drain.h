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
  std::unique_lock<std::mutex> lock(inv.mu);
  const bool arrived = inv.arrived == plan.axis_size;
  // Under the lock that arrivals take: no rank can become the last after.
  if (!arrived) inv.abandoned = true;
  lock.unlock();
  if (arrived) {
    SpinThenWait(lock, inv.cv, DeadlineAfter(plan.timeout_ms),
                 [&] { return inv.issued.load() || inv.failed(); });
    lock.unlock();
  }
  if (!inv.issued) {
    Abandon(d.inv, d.rank, device, where + ": " + cause);
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
  registry.NoteFailure(device, run_id);
  for (const auto& d : registry.DropRun(device, run_id)) {
    DrainPart(backend, device, d, cause);
  }
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_PEER_COPY_DRAIN_H_
