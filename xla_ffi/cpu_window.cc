// CPU twin of the window and push transports: windows are POSIX shared
// memory (so ranks in other processes of this host map them too), flags are
// atomics in them, queues are the twin's worker threads (cpu_runtime.h), and
// a queue's flag wait polls with a deadline, so a peer that never signals
// fails the invocation instead of hanging it. wait, done and the push
// finish return futures, as in the rendezvous twin (XLA:CPU's handler pool
// is small).

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_backend.h"
#include "cpu_runtime.h"
#include "dispatch_advice.h"
#include "event_pool.h"
#include "ficco_ffi.h"
#include "gather_push_protocol.h"
#include "gemm.h"
#include "push_protocol.h"
#include "push_sum.h"
#include "start_instance.h"
#include "window.h"
#include "window_protocol.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {
namespace {

// Window queues are threads of their own, apart from the rendezvous
// transport's queues.
constexpr int64_t kQueueBase = int64_t{1} << 32;

// The cyclic comparison of cuStreamWaitValue32(GEQ): epochs may wrap.
bool Reached(const uint32_t* addr, uint32_t value) {
  return static_cast<int32_t>(__atomic_load_n(addr, __ATOMIC_ACQUIRE) -
                              value) >= 0;
}

// One window's operations on one copy queue of a device, in order: a lane.
// Why lanes: XLA:CPU runs a program's independent ops in whatever order
// they become ready, so two devices may start two chains of one program
// (the rings and chunks of a bidirectional schedule) in opposite orders. On
// one FIFO queue a flag wait of one chain would then hold back the other
// chain's copies that the peer it waits for needs first: a cycle across
// devices that only the timeout would break. A GPU runs a program's ops in
// one order on every device, so its streams need no lanes. Within a window
// (one call site) the epochs stay in order, which the flags' >= semantics
// rely on; a lane whose head is not ready yields the queue to other lanes.
class Lane {
 public:
  // Runs now or later; false: not ready, call again later (it must not
  // block).
  using Op = std::function<bool()>;

  static void Push(const Window* w, int32_t device, int64_t queue, Op op) {
    static std::mutex* mu = new std::mutex();
    static auto* lanes = new std::map<std::tuple<const Window*, int32_t,
                                                 int64_t>, Lane*>();
    Lane* lane;
    {
      std::lock_guard<std::mutex> lock(*mu);
      Lane*& l = (*lanes)[{w, device, queue}];
      // Lanes outlive their windows (a retired window is freed once its
      // ops, which hold it, have run): a window made later at the same
      // address takes over the empty lane.
      if (l == nullptr) l = new Lane(&Queue(device, kQueueBase + queue));
      lane = l;
    }
    lane->Add(std::move(op));
  }

 private:
  explicit Lane(CopyQueue* queue) : queue_(queue) {}

  void Add(Op op) {
    bool schedule;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ops_.push_back(std::make_shared<Op>(std::move(op)));
      schedule = !scheduled_;
      scheduled_ = true;
    }
    if (schedule) queue_->Push([this] { Drain(); });
  }

  // On the queue's thread: runs the lane's ops until it is empty or its
  // head is not ready; then it goes to the back of the queue, after a nap
  // that grows while nothing moves (the queue's other lanes ran meanwhile).
  void Drain() {
    for (;;) {
      std::shared_ptr<Op> op;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (ops_.empty()) {
          scheduled_ = false;
          return;
        }
        op = ops_.front();
      }
      if (!(*op)()) {
        std::this_thread::sleep_for(nap_);
        nap_ = std::min(nap_ * 2, std::chrono::microseconds(200));
        queue_->Push([this] { Drain(); });
        return;
      }
      nap_ = std::chrono::microseconds(1);
      std::lock_guard<std::mutex> lock(mu_);
      ops_.pop_front();
    }
  }

  CopyQueue* const queue_;
  std::mutex mu_;
  std::deque<std::shared_ptr<Op>> ops_;
  bool scheduled_ = false;
  std::chrono::microseconds nap_{1};  // Only the queue's thread uses it.
};

// A timeout's tail: "; never signalled: rank 2 (device 2) ..." when some
// peer is late (the window's header is host memory here, so any timeout
// can name who is), else what this device's copies queued behind.
std::string Late(const WindowInvocation<CpuBackend>& inv) {
  const std::string missing = Unsignalled(
      *inv.win, reinterpret_cast<const uint32_t*>(inv.win->base), inv.epoch,
      inv.freed_lag);
  return "; " + (missing.empty() ? QueuedBehind(inv) : NeverSignalled(missing));
}

// Every operation goes to its window's lane on the queue (`Lane`).
void Push(const std::shared_ptr<WindowInvocation<CpuBackend>>& inv,
          int32_t device, int64_t queue, std::function<void()> op) {
  Lane::Push(inv->win.get(), device, queue, [op = std::move(op)] {
    op();
    return true;
  });
}

// A wait that is not over yields its lane until it is, or until its
// bound passes (counted from when it reached the head of its lane).
void PushWait(const std::shared_ptr<WindowInvocation<CpuBackend>>& inv,
              int32_t device, int64_t queue, int64_t ms,
              std::function<bool()> over, std::function<void()> late) {
  auto deadline = std::make_shared<std::optional<Clock::time_point>>();
  Lane::Push(inv->win.get(), device, queue,
             [inv, ms, over = std::move(over), late = std::move(late),
              deadline] {
               // A failed invocation skips its copies: stop waiting for
               // them too, so its queues drain at once (`WhenSettled`).
               if (inv->failed() || over()) return true;
               // Another device here found the ranks' epochs disagree
               // (epoch_runs.h): fail with its reason, not at the deadline.
               if (inv->win->Poisoned()) {
                 inv->Fail(inv->win->Sticky());
                 return true;
               }
               if (!deadline->has_value()) *deadline = DeadlineAfter(ms);
               if (Clock::now() < **deadline) return false;
               late();
               return true;
             });
}

}  // namespace

// The window and push transports' queues: every operation goes to its
// window's lane (`Lane`).
ffi::Error CpuBackend::WaitEvent(const std::shared_ptr<WindowInv>& inv,
                                 int32_t device, int64_t queue, Event* e) {
  // Events are this device's own: they are late only because a flag wait
  // is, and that wait's message (which names the rank) should win, so
  // this bound is twice the op's.
  const int64_t ms = 2 * inv->plan.timeout_ms;
  const std::string why = inv->where + ": a copy queue waited more than " +
                          std::to_string(ms) + " ms for an event, or it" +
                          " failed";
  PushWait(inv, device, queue, ms,
           [inv, e, why] {
             // A failed event fails its waiter at once.
             const CpuEvent::State s = e->Peek();
             if (s == CpuEvent::kFailed) inv->Fail(why + Late(*inv));
             return s != CpuEvent::kPending;
           },
           [inv, why] { inv->Fail(why + Late(*inv)); });
  return ffi::Error::Success();
}

ffi::Error CpuBackend::Copy(const std::shared_ptr<WindowInv>& inv,
                            int32_t device, int64_t queue, char* dst,
                            const char* src, size_t bytes) {
  Push(inv, device, queue, [inv, dst, src, bytes] {
    if (!inv->failed() && bytes > 0) std::memcpy(dst, src, bytes);
  });
  return ffi::Error::Success();
}

ffi::Error CpuBackend::Record(const std::shared_ptr<WindowInv>& inv,
                              int32_t device, int64_t queue, Event* e) {
  Push(inv, device, queue, [inv, e] {
    e->Set(inv->failed() ? CpuEvent::kFailed : CpuEvent::kOk);
  });
  return ffi::Error::Success();
}

ffi::Error CpuBackend::WaitFlag(const std::shared_ptr<WindowInv>& inv,
                                int32_t device, int64_t queue, uint32_t* addr,
                                uint32_t value, const std::string& who) {
  const int64_t ms = inv->plan.timeout_ms;
  PushWait(inv, device, queue, ms, [addr, value] { return Reached(addr, value); },
           [inv, ms, who] {
             inv->Fail(inv->where + ": waited more than " +
                       std::to_string(ms) + " ms for " + who + Late(*inv));
           });
  return ffi::Error::Success();
}

ffi::Error CpuBackend::WaitUntil(const std::shared_ptr<WindowInv>& inv,
                                 int32_t device, int64_t queue,
                                 std::function<bool()> over,
                                 const std::string& who) {
  const int64_t ms = inv->plan.timeout_ms;
  PushWait(inv, device, queue, ms, std::move(over), [inv, ms, who] {
    inv->Fail(inv->where + ": waited more than " + std::to_string(ms) +
              " ms for " + who + Late(*inv));
  });
  return ffi::Error::Success();
}

ffi::Error CpuBackend::FlagOps(const std::shared_ptr<WindowInv>& inv,
                               int32_t device, int64_t queue,
                               const std::vector<FlagOp>& ops) {
  for (const FlagOp& op : ops) {
    FICCO_RETURN_IF_FAILED(
        op.write ? WriteFlag(inv, device, queue, op.addr, op.value)
                 : WaitFlag(inv, device, queue, op.addr, op.value, op.who));
  }
  return ffi::Error::Success();
}

ffi::Error CpuBackend::InLane(const std::shared_ptr<WindowInv>& inv,
                              int32_t device, int64_t queue,
                              std::function<void()> op) {
  Push(inv, device, queue, std::move(op));
  return ffi::Error::Success();
}

ffi::Error CpuBackend::Sum(const std::shared_ptr<WindowInv>& inv,
                           int32_t device, int64_t queue, ffi::DataType dtype,
                           char* out, const char* own, const char* landing,
                           int64_t chunks, int64_t peers, int64_t chunk_elems) {
  const PushSumArgs args{dtype, out, own, landing, chunks, peers,
                         chunk_elems};
  Push(inv, device, queue, [inv, args] {
    if (inv->failed()) return;
    if (ffi::Error err = CpuPushSum(args); err.failure()) {
      inv->Fail(inv->where + ": " + std::string(err.message()));
    }
  });
  return ffi::Error::Success();
}

ffi::Error CpuBackend::Gemm(const std::shared_ptr<WindowInv>& inv,
                            int32_t device, int64_t queue, const GemmArgs& g) {
  Push(inv, device, queue, [inv, g] {
    if (inv->failed()) return;
    if (ffi::Error err = CpuGemm(g); err.failure()) {
      inv->Fail(inv->where + ": " + std::string(err.message()));
    }
  });
  return ffi::Error::Success();
}

// A failed invocation writes no flag: its peers must not read garbage.
ffi::Error CpuBackend::WriteFlag(const std::shared_ptr<WindowInv>& inv,
                                 int32_t device, int64_t queue, uint32_t* addr,
                                 uint32_t value) {
  Push(inv, device, queue, [inv, addr, value] {
    if (!inv->failed()) __atomic_store_n(addr, value, __ATOMIC_RELEASE);
  });
  return ffi::Error::Success();
}

namespace {

using Inv = WindowInvocation<CpuBackend>;

ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

ffi::Future Ready() {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetAvailable();
  return future;
}

// Every event of the invocations of `run`, and the longest of their
// timeouts (a failed run is settled once they are all set, or by twice it).
std::vector<CpuEvent*> RunEvents(const std::vector<std::shared_ptr<Inv>>& run,
                                 int64_t* timeout_ms) {
  std::vector<CpuEvent*> events;
  for (const auto& inv : run) {
    *timeout_ms = std::max(*timeout_ms, inv->plan.timeout_ms);
    for (CpuEvent* e : inv->AllEvents()) {
      if (e != nullptr) events.push_back(e);
    }
  }
  return events;
}

// Runs `then` on the device's completion thread once every event of the
// invocations in `run` is set, or after twice their op's timeout. A wait or
// done that fails hands its error to XLA, which then frees the execution's
// buffers: the copies of every invocation that execution started here must
// have ended first (failed, they skip the rest), or one could still write a
// landing buffer or read a source that a later call owns.
void WhenSettled(int32_t device, std::vector<std::shared_ptr<Inv>> run,
                 std::function<void()> then) {
  struct Settle {
    std::mutex mu;
    int64_t remaining = 0;
    bool fired = false;
    Watchdog::Timer timer;
    std::function<void()> then;
    std::vector<std::shared_ptr<Inv>> run;  // Their events stay theirs.
  };
  auto st = std::make_shared<Settle>();
  st->then = std::move(then);
  int64_t timeout_ms = 0;
  std::vector<CpuEvent*> events = RunEvents(run, &timeout_ms);
  st->run = std::move(run);
  auto fire = [st, device] {
    std::function<void()> then;
    Watchdog::Timer t;
    {
      std::lock_guard<std::mutex> lock(st->mu);
      if (st->fired) return;
      st->fired = true;
      then = std::move(st->then);
      t = st->timer;
    }
    Watchdog::Get().Cancel(t);
    Completer(device).Push([st, then = std::move(then)] {
      then();
      std::lock_guard<std::mutex> lock(st->mu);
      st->run.clear();
    });
  };
  {
    std::lock_guard<std::mutex> lock(st->mu);
    st->remaining = static_cast<int64_t>(events.size()) + 1;
  }
  const auto timer = Watchdog::Get().At(DeadlineAfter(2 * timeout_ms), fire);
  {
    std::lock_guard<std::mutex> lock(st->mu);
    st->timer = timer;
  }
  auto one_less = [st, fire](CpuEvent::State) {
    bool last;
    {
      std::lock_guard<std::mutex> lock(st->mu);
      last = --st->remaining == 0;
    }
    if (last) fire();
  };
  for (CpuEvent* e : events) e->OnSet(one_less);
  one_less(CpuEvent::kOk);  // The registrations above are done.
}

// The failure of a wait or done that found its invocation, of a push
// all-gather once its pushes may be enqueued, or of a push finish once it
// holds its start's invocation (their `drain`): fails it and the other
// invocations its execution started here (their queued copies are skipped)
// and completes once their copies have ended.
ffi::Future FailSettled(int32_t device, const std::shared_ptr<Inv>& inv,
                        ffi::Error error) {
  auto run = WindowIndex<CpuBackend>::Get().FailRun(
      inv, inv->where + ": " + std::string(error.message()));
  ffi::Promise promise;
  ffi::Future future(promise);
  WhenSettled(device, std::move(run), [promise, error]() mutable {
    promise.SetError(error);
  });
  return future;
}

// FailSettled for the push start, whose handler returns no future: the
// same failure, waited for on the handler's thread, as the rendezvous start
// does (DrainFailedRun). It waits only for the events, which this device's
// queues set (skipping a failed invocation's copies), for at most twice the
// timeout, as WhenSettled; not through the completion thread, as
// FailSettled's future does, since XLA may run this handler on it.
ffi::Error FailSettledNow(const std::shared_ptr<Inv>& inv, ffi::Error error) {
  auto run = WindowIndex<CpuBackend>::Get().FailRun(
      inv, inv->where + ": " + std::string(error.message()));
  int64_t timeout_ms = 0;
  const std::vector<CpuEvent*> events = RunEvents(run, &timeout_ms);
  const auto deadline = DeadlineAfter(2 * timeout_ms);
  CpuBackend backend;
  for (CpuEvent* e : events) backend.DrainWait(e, deadline);
  return error;
}

// Completes once every event is set, with an error if one failed or the
// deadline passed first. Exactly once; off the handler's thread unless it
// is already decided inside the handler (XLA continues the device's
// execution on the completing thread).
struct Await : std::enable_shared_from_this<Await> {
  ffi::Promise promise;
  int32_t device = 0;
  std::shared_ptr<Inv> inv;
  std::string what;
  std::mutex mu;
  bool completed = false;
  int64_t remaining = 0;
  bool in_handler = false;
  std::thread::id handler_thread;
  Watchdog::Timer timer;  // Cancelled on completion.

  void Finish(bool ok, const std::string& why) {
    std::shared_ptr<Inv> held;
    bool inline_now;
    Watchdog::Timer t;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (completed) return;
      completed = true;
      held = std::move(inv);
      inline_now =
          in_handler && std::this_thread::get_id() == handler_thread;
      t = timer;
    }
    Watchdog::Get().Cancel(t);
    auto self = shared_from_this();
    auto complete = [self, ok, why] {
      if (ok) {
        self->promise.SetAvailable();
      } else {
        self->promise.SetError(ffi::Error(ffi::ErrorCode::kDeadlineExceeded, why));
      }
    };
    if (!ok && held) {
      // XLA frees the execution's buffers once it sees the error: let the
      // copies of every invocation it started here end first.
      WhenSettled(device,
                  WindowIndex<CpuBackend>::Get().FailRun(held, why),
                  std::move(complete));
      return;
    }
    if (inline_now) {
      complete();
    } else {
      Completer(device).Push(std::move(complete));
    }
  }
};

ffi::Future AwaitEvents(int32_t device, const std::shared_ptr<Inv>& inv,
                        std::vector<CpuEvent*> events, const std::string& what) {
  auto a = std::make_shared<Await>();
  ffi::Future future(a->promise);
  a->device = device;
  a->inv = inv;
  a->what = what;
  a->remaining = static_cast<int64_t>(events.size());
  a->in_handler = true;
  a->handler_thread = std::this_thread::get_id();
  std::weak_ptr<Await> weak = a;
  const int64_t ms = inv->plan.timeout_ms;
  const auto timer = Watchdog::Get().At(DeadlineAfter(ms), [weak, ms] {
    auto a = weak.lock();
    if (!a) return;
    std::shared_ptr<Inv> inv;
    {
      std::lock_guard<std::mutex> lock(a->mu);
      inv = a->inv;
    }
    if (!inv) return;
    std::string why = inv->Failure();
    if (why.empty()) {
      why = inv->where + ": " + a->what + " took more than " +
            std::to_string(ms) + " ms" + Late(*inv);
      inv->Fail(why);
    }
    a->Finish(false, why);
  });
  {
    std::lock_guard<std::mutex> lock(a->mu);
    a->timer = timer;
  }
  if (events.empty()) a->Finish(true, "");
  for (CpuEvent* e : events) {
    e->OnSet([a](CpuEvent::State s) {
      if (s == CpuEvent::kFailed) {
        std::shared_ptr<Inv> inv;
        {
          std::lock_guard<std::mutex> lock(a->mu);
          inv = a->inv;
        }
        return a->Finish(false, inv ? inv->Failure() : "failed");
      }
      bool last;
      {
        std::lock_guard<std::mutex> lock(a->mu);
        last = --a->remaining == 0;
      }
      if (last) a->Finish(true, "");
    });
  }
  {
    std::lock_guard<std::mutex> lock(a->mu);
    a->in_handler = false;
  }
  return future;
}

// A wait or done that the fault test hook refuses: it fails the invocation
// it found, as any failing wait or done does (FailSettled).
ffi::Future Refused(int32_t device, const std::shared_ptr<Inv>& inv,
                    std::string_view phase, std::string_view op) {
  ffi::Error refused(ffi::ErrorCode::kUnavailable,
                     WindowWho(phase, op, device) +
                         ": refused by the fault test hook");
  return inv ? FailSettled(device, inv, std::move(refused))
             : Failed(std::move(refused));
}

ffi::Error StartImpl(ffi::RunId run_id, StartInstance* instance,
                     int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets,
                     Attrs attrs) {
  CpuBackend backend;
  return WindowStart(backend, run_id.run_id, InstanceId(instance), device,
                     args, rets, attrs);
}

ffi::Future WaitImpl(ffi::RunId run_id, int32_t device, ffi::AnyBuffer buf,
                     ffi::Result<ffi::AnyBuffer> out, Attrs attrs) {
  if (buf.untyped_data() != out->untyped_data()) {
    return Failed(ffi::Error::Internal("ficco window wait: output not aliased"));
  }
  auto [inv, landing] = WindowIndex<CpuBackend>::Get().TakeWait(
      attrs.window, device, buf.untyped_data(), run_id.run_id);
  if (Faults(device, kFaultWait)) {
    return Refused(device, inv, "wait", attrs.op_name);
  }
  if (!inv) {
    return Failed(WindowMissError<CpuBackend>(attrs.window, "wait",
                                                    attrs.op_name, device));
  }
  if (attrs.landed) {
    // A landed wait only host-orders a kernel that waits on the landing
    // flags; the twin issues its copies inside the start, so they are.
    if (ffi::Error err = AwaitIssued(*inv, WindowWho("wait", attrs.op_name,
                                                     device));
        err.failure()) {
      return Failed(std::move(err));
    }
    return Ready();
  }
  std::vector<CpuEvent*> events;
  for (size_t i = 0; i < inv->plan.transfers.size(); ++i) {
    if (inv->plan.transfers[i].dst == landing) events.push_back(inv->arrival[i]);
  }
  return AwaitEvents(device, inv, std::move(events),
                     "the pieces of landing buffer " + std::to_string(landing));
}

ffi::Future DoneImpl(ffi::RunId run_id, int32_t device,
                     ffi::AnyBuffer out_in,
                     ffi::RemainingArgs keepalive,
                     ffi::Result<ffi::AnyBuffer> out, Attrs attrs) {
  if (out_in.untyped_data() != out->untyped_data()) {
    return Failed(ffi::Error::Internal("ficco window done: output not aliased"));
  }
  auto first = keepalive.get<ffi::AnyBuffer>(0);
  if (!first.has_value()) return Failed(first.error());
  auto inv = WindowIndex<CpuBackend>::Get().TakeDone(
      attrs.window, device, first->untyped_data(), run_id.run_id);
  if (Faults(device, kFaultDone)) {
    return Refused(device, inv, "done", attrs.op_name);
  }
  if (!inv) {
    return Failed(WindowMissError<CpuBackend>(attrs.window, "done",
                                                    attrs.op_name, device));
  }
  // The sources have been staged (XLA may reuse them) and this rank's own
  // pulls are over; peers' reads of the window are the next start's
  // concern (it waits for their freed flags).
  std::vector<CpuEvent*> events = inv->finals;
  events.push_back(inv->staged);
  return AwaitEvents(device, inv, std::move(events),
                     "staging the sources and this rank's pulls");
}

ffi::Error PushArmImpl(ffi::RunId run_id, int32_t device,
                       ffi::AnyBuffer /*after*/,
                       ffi::Result<ffi::AnyBuffer> flags,
                       ffi::Result<ffi::AnyBuffer> rank, Attrs attrs) {
  CpuBackend backend;
  return PushArm(backend, run_id.run_id, device, *flags, *rank, attrs);
}

ffi::Error PushStartImpl(ffi::RunId run_id, StartInstance* instance,
                         int32_t device,
                         ffi::AnyBuffer parts, ffi::AnyBuffer flags,
                         ffi::Result<ffi::AnyBuffer> flags_out,
                         Attrs attrs) {
  if (flags.untyped_data() != flags_out->untyped_data()) {
    return ffi::Error::Internal("ficco push start: flags not aliased");
  }
  CpuBackend backend;
  std::shared_ptr<Inv> drain;
  ffi::Error err =
      PushStart(backend, run_id.run_id, InstanceId(instance), device, parts,
                flags, attrs, &drain);
  // Its queued pushes read parts (FailSettledNow). The twin's queue
  // operations never fail to enqueue, so this guards a backend change.
  if (err.failure() && drain != nullptr) {
    return FailSettledNow(drain, std::move(err));
  }
  return err;
}

ffi::Future PushFinishImpl(int32_t device, ffi::AnyBuffer parts,
                           ffi::AnyBuffer /*flags: kept alive*/,
                           ffi::Result<ffi::AnyBuffer> out,
                           Attrs attrs) {
  CpuBackend backend;
  std::shared_ptr<Inv> drain;
  auto inv = PushFinish(backend, device, parts, *out, attrs, &drain);
  if (!inv.has_value()) {
    // The start's queued pushes read parts, and its sum may be queued too
    // (FailSettled).
    return drain ? FailSettled(device, drain, inv.error())
                 : Failed(inv.error());
  }
  return AwaitEvents(device, *inv, {(*inv)->signalled},
                     "the peers' pieces and the sum");
}

ffi::Future PushGatherImpl(ffi::RunId run_id, StartInstance* instance,
                           int32_t device,
                           ffi::AnyBuffer x, ffi::AnyBuffer w,
                           ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> gathered,
                           Attrs attrs) {
  CpuBackend backend;
  std::shared_ptr<Inv> drain;
  auto inv = PushGather(backend, run_id.run_id, InstanceId(instance), device, x, w, *out,
                        *gathered, attrs, &drain);
  if (!inv.has_value()) {
    // Its queued copies and GEMMs use XLA's buffers (FailSettled).
    return drain ? FailSettled(device, drain, inv.error())
                 : Failed(inv.error());
  }
  return AwaitEvents(device, *inv, {(*inv)->staged, (*inv)->signalled},
                     "the pushes, the peers' shards and the products");
}

}  // namespace

// --- window memory: POSIX shared memory ------------------------------------

// The window is shared memory, so its host words sit in it too.
ffi::Error CpuWindowAllocate(Window& w, std::string* handle) {
  const std::string name = ShmName("w", w);
  const size_t bytes = kHeaderBytes + kHostBytes + kSlots * w.slot_bytes;
  auto p = ShmCreate(name, bytes);
  if (!p.has_value()) return p.error();
  // Peers in other processes keep the memory while they map it; the name
  // is gone already unless the family was never sealed.
  w.release.push_back([base = *p, bytes, name](bool) {
    shm_unlink(name.c_str());
    munmap(base, bytes);
  });
  w.base = *p;
  w.host = reinterpret_cast<uint32_t*>(w.base + kHeaderBytes);
  *handle = name;
  w.host_name = name;
  return ffi::Error::Success();
}

ffi::Error CpuWindowMap(Window& w, int64_t peer, const std::string& handle) {
  const size_t bytes = kHeaderBytes + kHostBytes + kSlots * w.slot_bytes;
  auto p = ShmOpen(handle, bytes);
  if (!p.has_value()) return p.error();
  w.release.push_back([base = *p, bytes](bool) { munmap(base, bytes); });
  w.peers[peer] = *p;
  w.peer_host[peer] = reinterpret_cast<uint32_t*>(*p + kHeaderBytes);
  return ffi::Error::Success();
}

int64_t CpuWindowPending() {
  return WindowIndex<CpuBackend>::Get().Pending() +
         PushStates<CpuBackend>::Get().Pending();
}

void CpuWindowForget(int64_t family) {
  PushStates<CpuBackend>::Get().Forget(family);
}

}  // namespace ficco

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoWindowStartCpu, ficco::StartImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()          // execution
                                  .Ctx<xla::ffi::State<ficco::StartInstance>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device
                                  .RemainingArgs()                 // sources
                                  .RemainingRets()                 // landings
                                  .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoWindowWaitCpu, ficco::WaitImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()          // execution
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device
                                  .Arg<xla::ffi::AnyBuffer>()      // landing
                                  .Ret<xla::ffi::AnyBuffer>()      // aliased
                                  .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoWindowDoneCpu, ficco::DoneImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()          // execution
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device
                                  .Arg<xla::ffi::AnyBuffer>()      // out
                                  .RemainingArgs()                 // keepalive
                                  .Ret<xla::ffi::AnyBuffer>()      // aliased
                                  .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoPushArmCpu, ficco::PushArmImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()          // execution
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device
                                  .Arg<xla::ffi::AnyBuffer>()      // after
                                  .Ret<xla::ffi::AnyBuffer>()      // flags
                                  .Ret<xla::ffi::AnyBuffer>()      // rank
                                  .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoPushStartCpu, ficco::PushStartImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()          // execution
                                  .Ctx<xla::ffi::State<ficco::StartInstance>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device
                                  .Arg<xla::ffi::AnyBuffer>()      // parts
                                  .Arg<xla::ffi::AnyBuffer>()      // flags
                                  .Ret<xla::ffi::AnyBuffer>()      // aliased
                                  .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoPushFinishCpu, ficco::PushFinishImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device
                                  .Arg<xla::ffi::AnyBuffer>()      // parts
                                  .Arg<xla::ffi::AnyBuffer>()      // flags
                                  .Ret<xla::ffi::AnyBuffer>()      // out
                                  .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoPushGatherCpu, ficco::PushGatherImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()          // execution
                                  .Ctx<xla::ffi::State<ficco::StartInstance>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device
                                  .Arg<xla::ffi::AnyBuffer>()      // x
                                  .Arg<xla::ffi::AnyBuffer>()      // w
                                  .Ret<xla::ffi::AnyBuffer>()      // out
                                  .Ret<xla::ffi::AnyBuffer>()      // gathered
                                  .Attrs<ficco::Attrs>());
