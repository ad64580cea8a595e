// CPU twin of the peer-copy protocol: copy queues are persistent worker
// threads, one per (device, stream index); events are flags with condition
// variables and callbacks; copies are memcpy between the virtual CPU
// devices' buffers.
//
// It is asynchronous like the GPU: start returns once the copies are queued
// (by the last rank to arrive, or handed to the issuer threads). sync, which
// waits for landing buffers and ends invocations, is an asynchronous FFI
// handler: XLA:CPU runs handlers on a small shared thread pool, where a
// handler that blocked for a peer could starve that peer's own start. It
// returns a future, completed when the awaited events are set, on a
// per-device completion thread (XLA continues the execution on it), or with
// an error when a watchdog finds the deadline passed.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpu_backend.h"
#include "cpu_runtime.h"
#include "event_pool.h"
#include "ficco_ffi.h"
#include "issuer.h"
#include "peer_copy_drain.h"
#include "peer_copy_plan.h"
#include "peer_copy_protocol.h"
#include "peer_copy_registry.h"
#include "start_instance.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

// The rendezvous transport's queues: a queue blocks on an event like a
// stream would, but never for longer than the op's timeout: it then fails
// the invocation, so its later copies are skipped and every event it
// records reads "failed".
ffi::Error CpuBackend::WaitEvent(const std::shared_ptr<Inv>& inv,
                                 int32_t device, int64_t queue, Event* e) {
  Queue(device, queue).Push([inv, device, queue, e] {
    if (inv->failed()) return;
    const int64_t ms = inv->plan->timeout_ms;
    if (e->WaitUntil(DeadlineAfter(ms)) == CpuEvent::kOk) return;
    inv->Fail("ficco peer copy of '" + inv->plan->op_name + "' (site " +
              std::to_string(inv->plan->site) + "): copy queue " +
              std::to_string(queue) + " of device " + std::to_string(device) +
              " waited more than " + std::to_string(ms) +
              " ms for a peer's data, or that copy failed");
  });
  return ffi::Error::Success();
}

ffi::Error CpuBackend::Copy(const std::shared_ptr<Inv>& inv, int32_t device,
                            int64_t queue, char* dst, const char* src,
                            size_t bytes) {
  Queue(device, queue).Push([inv, dst, src, bytes] {
    if (!inv->failed() && bytes > 0) std::memcpy(dst, src, bytes);
  });
  return ffi::Error::Success();
}

ffi::Error CpuBackend::Record(const std::shared_ptr<Inv>& inv, int32_t device,
                              int64_t queue, Event* e) {
  Queue(device, queue).Push([inv, e] {
    e->Set(inv->failed() ? CpuEvent::kFailed : CpuEvent::kOk);
  });
  return ffi::Error::Success();
}

// CUDA's flag stream, on a queue of its own: `out` is set once `*flag >=
// target` (after `after`), or failed past the plan's timeout, which the
// copies waiting on it then report. XLA:CPU runs the start only after the
// kernel's results are complete, so here the wait is a check.
ffi::Error CpuBackend::FlagReady(int32_t device, int64_t /*flag_index*/,
                                 const int32_t* flag, int64_t target,
                                 Event* after, Event* out, int64_t timeout_ms) {
  Queue(device, kFlagQueue).Push([flag, target, after, out, timeout_ms] {
    const auto deadline = DeadlineAfter(timeout_ms);
    bool ok = after->WaitUntil(deadline) == CpuEvent::kOk;
    const auto* atomic_flag = reinterpret_cast<const std::atomic<int32_t>*>(flag);
    while (ok && atomic_flag->load(std::memory_order_acquire) < target) {
      if (Clock::now() >= deadline) ok = false;
      std::this_thread::yield();
    }
    out->Set(ok ? CpuEvent::kOk : CpuEvent::kFailed);
  });
  return ffi::Error::Success();
}

namespace {

// One asynchronous wait or done: completes its future exactly once, with
// the first of success (every awaited event set), a failure, or the
// deadline.
struct Pending {
  ffi::Promise promise;
  int32_t device = 0;
  int64_t timeout_ms = 0;
  bool is_done = false;
  std::mutex mu;
  bool completed = false;
  int64_t remaining = 0;
  Found<CpuBackend> found;  // Released on completion (it holds the invocation).
  Watchdog::Timer timer;    // Cancelled on completion.
};

// The wait or done whose handler is running on this thread. Only its own
// future may complete inline (the handler then returns a ready future); any
// other one, e.g. a peer's wait armed when this start issues the group,
// completes on its device's completion thread, or that device's execution
// would continue inside this handler and could block on this very device.
thread_local const Pending* in_handler = nullptr;

void Finish(const std::shared_ptr<Pending>& p, const std::string& failure) {
  Found<CpuBackend> f;
  Watchdog::Timer timer;
  {
    std::lock_guard<std::mutex> lock(p->mu);
    if (p->completed) return;
    p->completed = true;
    f = std::move(p->found);
    timer = p->timer;
  }
  Watchdog::Get().Cancel(timer);
  std::optional<ffi::Error> error;
  if (failure.empty()) {
    if (p->is_done) MarkLeft(*f.inv, f.rank);
  } else {
    error = Abandon(f.inv, f.rank, p->device, f.where + ": " + failure);
    // The rest of this execution on this device will not run. Its other
    // registrations are dropped without being drained: this thread may be
    // a copy queue or the watchdog, which must not block, and past a
    // timeout or a peer's failure their copies have ended or are skipped.
    Registry<CpuBackend>::Get().DropRun(p->device, f.inv->key.run_id);
  }
  f.inv.reset();
  auto complete = [p, error] {
    if (error) {
      p->promise.SetError(*error);
    } else {
      p->promise.SetAvailable();
    }
  };
  if (in_handler == p.get()) {
    complete();
  } else {
    Completer(p->device).Push(std::move(complete));
  }
}

std::string FailureOf(Invocation<CpuBackend>& inv, int64_t timeout_ms) {
  std::lock_guard<std::mutex> lock(inv.mu);
  return StallFailure(inv, timeout_ms);
}

// Completes once the invocation is issued and every event that `collect`
// names is set.
ffi::Future Await(Found<CpuBackend> found, int32_t device, int64_t timeout_ms,
                  bool is_done,
                  std::function<std::vector<CpuEvent*>(Invocation<CpuBackend>&,
                                                       int64_t rank)> collect) {
  auto p = std::make_shared<Pending>();
  ffi::Future future(p->promise);
  p->device = device;
  p->timeout_ms = timeout_ms;
  p->is_done = is_done;
  auto inv = found.inv;
  const int64_t rank = found.rank;
  p->found = std::move(found);
  auto arm = [p, inv, rank, collect] {
    if (inv->failed()) return Finish(p, FailureOf(*inv, p->timeout_ms));
    std::vector<CpuEvent*> events = collect(*inv, rank);
    {
      std::lock_guard<std::mutex> lock(p->mu);
      p->remaining = static_cast<int64_t>(events.size());
    }
    if (events.empty()) return Finish(p, "");
    for (CpuEvent* e : events) {
      e->OnSet([p, inv](CpuEvent::State s) {
        if (s == CpuEvent::kFailed) {
          return Finish(p, FailureOf(*inv, p->timeout_ms));
        }
        bool last;
        {
          std::lock_guard<std::mutex> lock(p->mu);
          last = --p->remaining == 0;
        }
        if (last) Finish(p, "");
      });
    }
  };
  bool now;
  {
    std::lock_guard<std::mutex> lock(inv->mu);
    now = inv->issued || inv->failed();
    if (!now) inv->on_issued.push_back(arm);
  }
  // Weak: a completed wait must not keep its invocation alive until the
  // deadline (p->found, which holds it, is emptied on completion).
  in_handler = p.get();
  std::weak_ptr<Invocation<CpuBackend>> weak = inv;
  const auto timer = Watchdog::Get().At(DeadlineAfter(timeout_ms), [p, weak] {
    if (auto inv = weak.lock()) Finish(p, FailureOf(*inv, p->timeout_ms));
  });
  bool completed;
  {
    std::lock_guard<std::mutex> lock(p->mu);
    p->timer = timer;
    completed = p->completed;
  }
  // Completed on another thread before the timer was stored: cancel here.
  if (completed) Watchdog::Get().Cancel(timer);
  if (now) arm();
  in_handler = nullptr;
  return future;
}

// The CPU queues' events complete in order too, but every callback is
// cheap here: await them all.
std::vector<CpuEvent*> EventsOf(const std::vector<Awaited<CpuBackend>>& all) {
  std::vector<CpuEvent*> events;
  for (const auto& a : all) events.push_back(a.event);
  return events;
}

ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

// A sync that fails before it took its part: this device's execution ends
// here, once the copies of what it still had registered have ended
// (peer_copy_drain.h). A part that fails later ends it through Finish.
ffi::Future FailedSync(int64_t run_id, int32_t device, ffi::Error error) {
  CpuBackend backend;
  DrainFailedRun(backend, run_id, device, error.message());
  return Failed(std::move(error));
}

ffi::Error StartImpl(ffi::RunId run_id, StartInstance* instance,
                     int32_t device, ffi::RemainingArgs args,
                     ffi::RemainingRets rets, Attrs attrs) {
  CpuBackend backend;
  ffi::Error err = Start(backend, run_id.run_id, InstanceId(instance), device,
                         args, rets, attrs);
  if (err.failure()) {
    DrainFailedRun(backend, run_id.run_id, device, err.message());
  }
  return err;
}

// One landing buffer's arrivals on this device.
ffi::Future AwaitLanding(int64_t run_id, int32_t device, const void* address,
                         const Attrs& attrs) {
  auto f = FindWait<CpuBackend>(run_id, device, address, attrs.op_name);
  if (!f.has_value()) {
    return FailedSync(run_id, device,
                      ExplainMiss<CpuBackend>(run_id, device, f.error()));
  }
  const int64_t landing = f->landing;
  return Await(std::move(*f), device, attrs.timeout_ms, /*is_done=*/false,
               [landing](Invocation<CpuBackend>& inv, int64_t rank) {
                 return EventsOf(LandingEvents(inv, rank, landing));
               });
}

// The copies that read the buffers of the invocation `keepalive` keeps
// alive (ReaderEvents).
ffi::Future AwaitDone(int64_t run_id, int32_t device,
                      const std::vector<const void*>& keepalive,
                      const Attrs& attrs) {
  auto f = FindDone<CpuBackend>(run_id, device, keepalive, attrs.op_name);
  if (!f.has_value()) {
    return FailedSync(run_id, device,
                      ExplainMiss<CpuBackend>(run_id, device, f.error()));
  }
  return Await(std::move(*f), device, attrs.timeout_ms, /*is_done=*/true,
               [](Invocation<CpuBackend>& inv, int64_t rank) {
                 return EventsOf(ReaderEvents(inv, rank));
               });
}

// One future per awaited landing buffer and ended invocation, joined: the
// call completes when all have (with an error if any failed), on the thread
// that completes the last one, as a single one would.
ffi::Future SyncUntimed(ffi::RunId run_id, int32_t device,
                        ffi::RemainingArgs args, ffi::RemainingRets rets,
                        const Attrs& attrs) {
  auto call = DecodeSync(args, rets, attrs);
  if (!call.has_value()) {
    return FailedSync(run_id.run_id, device, call.error());
  }
  if (auto why = SyncFault(device, !call->waits.empty(),
                           !call->groups.empty(), attrs.op_name);
      !why.empty()) {
    return FailedSync(run_id.run_id, device,
                      ffi::Error(ffi::ErrorCode::kUnavailable, why));
  }
  std::vector<ffi::Future> parts;
  for (const void* address : call->waits) {
    parts.push_back(AwaitLanding(run_id.run_id, device, address, attrs));
  }
  for (const auto& group : call->groups) {
    parts.push_back(AwaitDone(run_id.run_id, device, group, attrs));
  }
  if (parts.empty()) {
    ffi::Promise promise;
    ffi::Future future(promise);
    promise.SetAvailable();
    return future;
  }
  if (parts.size() == 1) return std::move(parts[0]);
  ffi::CountDownPromise joined(static_cast<int64_t>(parts.size()));
  ffi::Future future(joined);
  // CountDown keeps the last error it is given; pass only the first, which
  // names the root cause (later ones read "a peer failed: ...").
  auto failed = std::make_shared<std::atomic<bool>>(false);
  for (auto& part : parts) {
    part.OnReady([joined, failed](
                     const std::optional<ffi::Error>& error) mutable {
      const bool first = error.has_value() && error->failure() &&
                         !failed->exchange(true);
      joined.CountDown(first ? *error : ffi::Error::Success());
    });
  }
  return future;
}

ffi::Future SyncImpl(ffi::RunId run_id, int32_t device, ffi::RemainingArgs args,
                     ffi::RemainingRets rets, Attrs attrs) {
  const auto since = Clock::now();
  Trace(device, kTraceSyncEnter, -1);
  ffi::Future future = SyncUntimed(run_id, device, args, rets, attrs);
  Registry<CpuBackend>::Get().stats().Add(kSyncTotal, since);
  // The CPU sync is asynchronous: this is when its future was returned.
  Trace(device, kTraceSyncExit, -1);
  return future;
}

ffi::Error ArmImpl(ffi::RunId run_id, int32_t device,
                   ffi::RemainingArgs /*like*/, ffi::RemainingRets rets,
                   Attrs attrs) {
  CpuBackend backend;
  ffi::Error err = Arm(backend, run_id.run_id, device, rets, attrs);
  if (err.failure()) {
    DrainFailedRun(backend, run_id.run_id, device, err.message());
  }
  return err;
}

}  // namespace

int64_t CpuLiveInvocations() { return Invocation<CpuBackend>::live.load(); }
// The rendezvous entries and the wait deadlines not yet fired or cancelled
// (those of both CPU transports: one watchdog).
int64_t CpuPendingEntries() {
  return Registry<CpuBackend>::Get().Pending() +
         static_cast<int64_t>(Watchdog::Get().Pending());
}
void CpuEventCounts(int device, int64_t* created, int64_t* pooled) {
  CpuEventPools().Counts(device, created, pooled);
}
bool CpuHostStat(int stat, int64_t* calls, int64_t* ns) {
  return Registry<CpuBackend>::Get().stats().Read(stat, calls, ns);
}
void CpuHostStatsReset() { Registry<CpuBackend>::Get().stats().Reset(); }
int CpuSetIssueMode(int mode) { return SetIssueMode<CpuBackend>(mode); }
int CpuIssueMode() { return Registry<CpuBackend>::Get().mode().load(); }

}  // namespace ficco

// Not command-buffer compatible (no ffi::Traits): the handlers rendezvous on
// the host and read fresh buffer addresses on every call.
XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoPeerCopyStartCpu, ficco::StartImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()          // execution
                                  .Ctx<xla::ffi::State<ficco::StartInstance>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device
                                  .RemainingArgs()                 // sources
                                  .RemainingRets()                 // landings
                                  .Attrs<ficco::Attrs>());    // plan

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoPeerCopySyncCpu, ficco::SyncImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()          // execution
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device
                                  .RemainingArgs()  // outs, keepalive
                                  .RemainingRets()  // outs, aliased
                                  .Attrs<ficco::Attrs>());  // layout

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoFlagsArmCpu, ficco::ArmImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()          // execution
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device
                                  .RemainingArgs()  // types only
                                  .RemainingRets()  // flags, rank, landings
                                  .Attrs<ficco::Attrs>());  // site
