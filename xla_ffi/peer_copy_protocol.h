// The rendezvous transport's peer-copy protocol (docs/protocol.md), written
// once over the backend (backend.h); cpu_peer_copy.cc and cuda_peer_copy.cu
// define the backend's rendezvous queues and bind the handlers.
//
// start publishes its rank; then, by the issue mode (issuer.h), each rank or
// its device's issuer thread issues the copies it receives (CUDA), or the
// last rank to arrive issues everyone's (the CPU twin's default). sync's
// waits and dones then wait for that issue and for events: CUDA handlers
// block their (dedicated, per-device) host thread for the issue, bounded,
// and enqueue stream waits (BlockingSync); the CPU twin returns futures
// instead, because XLA:CPU runs handlers on a small shared pool where a
// blocked thread can starve a peer's start.
// The queue operations may name any device here (the last rank to arrive
// issues for all).

#ifndef FICCO_XLA_FFI_PEER_COPY_PROTOCOL_H_
#define FICCO_XLA_FFI_PEER_COPY_PROTOCOL_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <set>
#include <tuple>
#include <string>
#include <string_view>
#include <vector>

#include "backend.h"
#include "dispatch_advice.h"
#include "host_trace.h"
#include "issuer.h"
#include "peer_copy_plan.h"
#include "peer_copy_registry.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

inline ffi::ErrorOr<BufferShape> ShapeOf(const ffi::AnyBuffer& b) {
  const auto dims = b.dimensions();
  if (dims.size() < 1) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "ficco peer copy: buffers must have a leading (row) dimension"));
  }
  int64_t row_elems = 1;
  for (size_t i = 1; i < dims.size(); ++i) row_elems *= dims[i];
  return BufferShape{dims[0], row_elems * static_cast<int64_t>(
                                              ffi::ByteWidth(b.element_type()))};
}

inline std::string RankList(const std::vector<int64_t>& ranks,
                            const Plan& plan, int64_t group) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    os << (i ? ", " : "") << "rank " << ranks[i] << " (device "
       << plan.devices[group * plan.axis_size + ranks[i]] << ")";
  }
  os << "]";
  return os.str();
}

// Copies transfer `i` into rank `r`'s landing buffer on r's copy queue and
// records its arrival. A forwarded piece (ring) is read from the landing
// buffer the source rank receives itself, after the queue waits for that
// buffer's arrival events there; the caller ensures they are recorded (a
// CUDA wait on an unrecorded event is a no-op). Both issue strategies use it.
template <class Backend>
ffi::Error CopyTransfer(Backend& backend,
                        const std::shared_ptr<Invocation<Backend>>& inv,
                        int64_t r, size_t i) {
  const Plan& plan = *inv->plan;
  const Transfer& t = plan.transfers[i];
  auto& me = inv->ranks[r];
  const auto& peer = inv->ranks[(r + t.src_offset) % plan.axis_size];
  ffi::Error err = ffi::Error::Success();
  const char* src = nullptr;
  if (t.src >= 0) {
    src = peer.sources[t.src];
  } else {
    const int64_t forwarded = -1 - t.src;
    for (size_t j = 0; err.success() && j < i; ++j) {
      if (plan.transfers[j].dst == forwarded) {
        err = backend.WaitEvent(inv, me.device, t.stream, peer.arrival[j]);
      }
    }
    src = peer.landings[forwarded];
  }
  if (err.success()) {
    err = backend.Copy(inv, me.device, t.stream,
                       me.landings[t.dst] + t.dst_row * inv->row_bytes,
                       src + t.src_row * inv->row_bytes,
                       static_cast<size_t>(t.rows * inv->row_bytes));
  }
  if (err.success()) {
    err = backend.Record(inv, me.device, t.stream, me.arrival[i]);
  }
  if (err.success()) me.stamps[i] = IssueStamp();
  return err;
}

// The event after which transfer `t` may read its rows of rank `peer`: the
// peer's start on its compute stream, or (flagged) the peer's flag of those
// rows reaching the target, which its kernel may do long before the start.
template <class Rank>
auto* SourceReady(const Rank& peer, const Transfer& t) {
  return t.src_flag >= 0 ? peer.piece_ready[t.src_flag] : peer.ready;
}

// Before rank `r`'s first copy: peer access from r's device to each of its
// sources, and every side stream of r waits for r's `ready`: XLA may have
// handed out the landing buffers' memory right after work still queued on
// r's compute stream, so no copy may write there before it is done.
template <class Backend>
ffi::Error PrepareRank(Backend& backend,
                       const std::shared_ptr<Invocation<Backend>>& inv,
                       int64_t r) {
  const Plan& plan = *inv->plan;
  const auto& me = inv->ranks[r];
  for (const Transfer& t : plan.transfers) {
    const int32_t peer =
        inv->ranks[(r + t.src_offset) % plan.axis_size].device;
    if (auto err = backend.EnsurePeerAccess(me.device, peer); err.failure()) {
      return err;
    }
  }
  for (int64_t stream : plan.streams_used) {
    if (auto err = backend.WaitEvent(inv, me.device, stream, me.ready);
        err.failure()) {
      return err;
    }
  }
  return ffi::Error::Success();
}

// Issues the copies of every rank, called once by the last rank to arrive.
// Transfer-major order: when transfer i of any rank forwards a landing
// buffer, the arrival events of the earlier transfers filling it are already
// recorded on every rank (a CUDA wait on an unrecorded event is a no-op).
// One invocation at a time, so every copy queue sees invocations in the same
// order and queues of different devices can never wait on each other in a
// cycle.
template <class Backend>
ffi::Error Issue(Backend& backend, const std::shared_ptr<Invocation<Backend>>& inv) {
  static std::mutex* issue_mu = new std::mutex();
  std::lock_guard<std::mutex> issue_lock(*issue_mu);
  const Plan& plan = *inv->plan;
  const int64_t p = plan.axis_size;
  auto& ranks = inv->ranks;
  for (int64_t r = 0; r < p; ++r) {
    if (auto err = PrepareRank(backend, inv, r); err.failure()) return err;
  }
  for (size_t i = 0; i < plan.transfers.size(); ++i) {
    const Transfer& t = plan.transfers[i];
    for (int64_t r = 0; r < p; ++r) {
      const auto& peer = ranks[(r + t.src_offset) % p];
      ffi::Error err = backend.WaitEvent(inv, ranks[r].device, t.stream,
                                        SourceReady(peer, t));
      if (err.success()) err = CopyTransfer(backend, inv, r, i);
      if (err.failure()) return err;
    }
  }
  return ffi::Error::Success();
}

// Issues the copies rank `r` receives (parallel or async issue), on a thread
// of r's device: XLA's, or its issuer.
// A forwarded copy waits, bounded, until the peer has recorded the arrival
// events of the landing buffer it forwards: the peer issues in plan order
// on its own thread, and a CUDA wait on an unrecorded event is a no-op.
template <class Backend>
ffi::Error IssueRank(Backend& backend,
                     const std::shared_ptr<Invocation<Backend>>& inv,
                     int64_t r, int64_t timeout_ms) {
  const Plan& plan = *inv->plan;
  const int64_t p = plan.axis_size;
  const auto& ranks = inv->ranks;
  const auto& me = ranks[r];
  bool forwards = false;
  for (const Transfer& t : plan.transfers) forwards |= t.src < 0;
  if (auto err = PrepareRank(backend, inv, r); err.failure()) return err;
  // (stream, peer rank, flag): each queue waits once per source event.
  std::set<std::tuple<int64_t, int64_t, int64_t>> ready_waited;
  const auto deadline = DeadlineAfter(timeout_ms);
  for (size_t i = 0; i < plan.transfers.size(); ++i) {
    const Transfer& t = plan.transfers[i];
    const int64_t peer_rank = (r + t.src_offset) % p;
    const auto& peer = ranks[peer_rank];
    ffi::Error err = ffi::Error::Success();
    if (ready_waited.insert({t.stream, peer_rank, t.src_flag}).second) {
      err = backend.WaitEvent(inv, me.device, t.stream, SourceReady(peer, t));
    }
    if (t.src < 0) {
      const int64_t forwarded = -1 - t.src;
      int64_t need = 0;  // Transfers [0, need) of the peer fill `forwarded`.
      for (size_t j = 0; j < i; ++j) {
        if (plan.transfers[j].dst == forwarded) need = j + 1;
      }
      {
        std::unique_lock<std::mutex> lock(inv->mu, std::defer_lock);
        if (!SpinThenWait(lock, inv->cv, deadline, [&] {
              return inv->recorded[peer_rank] >= need || inv->failed();
            }) || inv->failed()) {
          return ffi::Error(
              ffi::ErrorCode::kDeadlineExceeded,
              inv->failed() ? "a peer failed: " + inv->failure
                            : "timed out after " + std::to_string(timeout_ms) +
                                  " ms waiting for rank " +
                                  std::to_string(peer_rank) +
                                  " to issue the copies it forwards");
        }
      }
    }
    if (err.success()) err = CopyTransfer(backend, inv, r, i);
    if (err.failure()) return err;
    if (forwards) {
      {
        std::lock_guard<std::mutex> lock(inv->mu);
        inv->recorded[r] = static_cast<int64_t>(i) + 1;
      }
      inv->cv.notify_all();
    }
  }
  return ffi::Error::Success();
}

// A failure of the issue half of an async start (on the issuer thread).
// The invocation is never marked issued, so the rank's sync, which waits
// for the issue, finds it failed and fails its execution.
template <class Backend>
void FailAsyncIssue(const std::shared_ptr<Invocation<Backend>>& inv,
                    const std::string& message) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(inv->mu);
    if (!inv->issued) inv->abandoned = true;  // Late arrivers fail at once.
    inv->FailLocked(message);
    callbacks.swap(inv->on_issued);
  }
  inv->cv.notify_all();
  for (auto& callback : callbacks) callback();
}

// The rest of start with parallel or async issue: wait (bounded) for every
// rank to publish, then enqueue this rank's copies; the last rank to finish
// marks the invocation issued for the waits and dones of every rank. Async
// issue runs this on the device's issuer thread, after start returned.
template <class Backend>
ffi::Error StartParallel(Backend& backend,
                         const std::shared_ptr<Invocation<Backend>>& inv,
                         const Key& key, int64_t rank, int32_t device,
                         bool last, const std::string& where,
                         int64_t timeout_ms, bool async) {
  const int64_t p = inv->plan->axis_size;
  auto& registry = Registry<Backend>::Get();
  const auto waited_since = Clock::now();
  Trace(device, kTraceIssueBegin, inv->plan->site);
  if (last) {
    registry.Forget(key, inv.get());
    inv->cv.notify_all();
  } else {
    std::unique_lock<std::mutex> lock(inv->mu, std::defer_lock);
    if (!SpinThenWait(lock, inv->cv, DeadlineAfter(timeout_ms), [&] {
          return inv->arrived == p || inv->failed();
        }) || inv->failed()) {
      const std::string message = where + ": " + StallFailure(*inv, timeout_ms);
      lock.unlock();
      if (async) {
        FailAsyncIssue(inv, message);
        return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, message);
      }
      return Abandon(inv, rank, device, message);
    }
  }
  const auto issue_since = Clock::now();
  Trace(device, kTracePeersArrived, inv->plan->site);
  registry.stats().Add(kStartRendezvous, waited_since);
  ffi::Error err = IssueRank(backend, inv, rank, timeout_ms);
  registry.stats().Add(kStartIssue, issue_since);
  if (err.failure()) {
    const std::string message =
        where + ": issuing this rank's copies: " + err.message();
    if (async) {
      FailAsyncIssue(inv, message);
      return ffi::Error(ffi::ErrorCode::kInternal, message);
    }
    inv->Fail(message);
    return Abandon(inv, rank, device, message);
  }
  // Before the invocation can read "issued": after that the op may finish,
  // and a trace read once it did must see no more writes.
  Trace(device, kTraceIssueEnd, inv->plan->site);
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(inv->mu);
    if (++inv->issued_ranks == p) {
      inv->issued = true;
      callbacks.swap(inv->on_issued);
    }
  }
  inv->cv.notify_all();
  for (auto& callback : callbacks) callback();
  return ffi::Error::Success();
}

// The C API's mode switch for Backend: the previous mode, or -1 (mode left
// as it was) if Backend cannot run `mode`.
template <class Backend>
int SetIssueMode(int mode) {
  if (!Backend::SupportsIssueMode(mode)) return -1;
  return Registry<Backend>::Get().mode().exchange(mode);
}

// A flagged start's rank events from its arm: the ready event the arm
// recorded before the kernel (landings free, flags zeroed), after checking
// that the flags and landing buffers are the very ones the arm handed out.
template <class Backend>
ffi::Error TakeArmed(int64_t run_id, int32_t device,
                     const Plan& plan, const char* flags,
                     typename Invocation<Backend>::Rank* mine) {
  typename Registry<Backend>::Armed armed;
  if (!Registry<Backend>::Get().PopArmed(device, run_id, plan.site, &armed)) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
        "no ficco_flags_arm of this site ran before this flagged start on"
        " this device and execution (arm, kernel, start must run in that"
        " order)");
  }
  mine->ready = armed.ready;  // Released with the rank from now on.
  // The CPU twin runs the start after the kernel's results are complete,
  // so a copied flags buffer holds the final counts there; on CUDA the copy
  // engines would wait on a buffer the kernel never bumps.
  if ((Backend::kFlagsMustAlias && armed.flags != flags) ||
      armed.landings != mine->landings) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
        "the flags or landing buffers differ from those ficco_flags_arm"
        " handed out: XLA copied one between them, so the copy engines"
        " could read flags or write landings the kernel does not use");
  }
  return ffi::Error::Success();
}

// ficco_flags_arm on `device`: zero the flags on the compute stream, write
// the device's rank on the axis (results: flags, rank, landings), record an
// event after that (and after everything XLA ran before, so the landing
// buffers are free), and hand it to this site's next start.
template <class Backend>
ffi::Error Arm(Backend& backend, int64_t run_id, int32_t device,
               ffi::RemainingRets rets, const Attrs& attrs) {
  const std::string where = "ficco_flags_arm of '" +
                            std::string(attrs.op_name) + "' (site " +
                            std::to_string(attrs.site) + ") on device " +
                            std::to_string(device);
  // This device's rank, found as start's Locate finds it.
  auto pos = LocateIn(attrs.devices, attrs.axis_size, device, where);
  if (!pos.has_value()) return pos.error();
  const int64_t rank = pos->rank;
  typename Registry<Backend>::Armed armed;
  if (rets.size() < 2) {
    return ffi::Error::InvalidArgument(
        where + ": expected at least 2 results (flags int32[n], rank" +
        " int32[]), got " + std::to_string(rets.size()));
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    char* data = static_cast<char*>((*b)->untyped_data());
    if (i > 1) {
      armed.landings.push_back(data);
      continue;
    }
    if ((*b)->element_type() != ffi::DataType::S32 ||
        (i == 1 && (*b)->element_count() != 1)) {
      return ffi::Error::InvalidArgument(
          where + (i == 0 ? ": result 0 (flags) must be int32[n]"
                          : ": result 1 (rank) must be int32[]") +
          ", got element type " +
          std::to_string(static_cast<int>((*b)->element_type())) + " and " +
          std::to_string((*b)->element_count()) + " elements");
    }
    ffi::Error err = i == 0 ? backend.ZeroOnCompute(data, (*b)->size_bytes())
                            : backend.SetInt32OnCompute(
                                  data, static_cast<int32_t>(rank));
    if (err.failure()) {
      return ffi::Error(err.errc().value_or(ffi::ErrorCode::kInternal),
                        where + ": " + err.message());
    }
    if (i == 0) armed.flags = data;
  }
  auto ev = Backend::AcquireEvent(device);
  if (!ev.has_value()) return ev.error();
  if (auto err = backend.RecordOnCompute(device, *ev); err.failure()) {
    Backend::ReleaseEvent(device, *ev);
    return err;
  }
  armed.ready = *ev;
  Registry<Backend>::Get().PushArmed(device, run_id, attrs.site,
                                     std::move(armed));
  return ffi::Error::Success();
}

// A rank that may not join `inv` (still gathering its ranks, as this one
// is missing) arrives and leaves at once and fails it, as a late arriver at
// an abandoned invocation does: none of its copies are ever issued, ranks
// that joined fail in their sync, later arrivers fail at once.
template <class Backend>
void RefuseJoin(const std::shared_ptr<Invocation<Backend>>& inv,
                const std::string& message) {
  std::vector<std::function<void()>> callbacks;
  bool forget;
  {
    std::lock_guard<std::mutex> lock(inv->mu);
    inv->abandoned = true;
    inv->FailLocked(message);
    callbacks.swap(inv->on_issued);
    ++inv->left;
    forget = ++inv->arrived == inv->left;
  }
  inv->cv.notify_all();
  for (auto& callback : callbacks) callback();
  if (forget) Registry<Backend>::Get().Forget(inv->key, inv.get());
}

// Start: publish this rank, then, by the issue mode (issuer.h): wait,
// bounded, for every rank to publish and enqueue the copies this rank
// receives (parallel); hand that to the device's issuer thread and return
// (async); or return at once and let the last rank to arrive issue
// everyone's copies, so that no pool thread waits for a peer (last, the CPU
// twin's default).
template <class Backend>
ffi::Error StartUntimed(Backend& backend, int64_t run_id, int64_t instance,
                        int32_t device,
                        ffi::RemainingArgs args, ffi::RemainingRets rets,
                        const Attrs& attrs) {
  using Inv = Invocation<Backend>;
  using Rank = typename Inv::Rank;
  auto& registry = Registry<Backend>::Get();
  const int mode = registry.mode().load(std::memory_order_relaxed);
  if (NeverArrives(device)) {
    return ffi::Error(ffi::ErrorCode::kAborted,
                      "ficco peer copy start of '" + std::string(attrs.op_name) +
                          "' on device " + std::to_string(device) +
                          ": test hook: this device never arrives");
  }
  Rank mine;
  mine.device = device;
  std::vector<BufferShape> source_shapes, landing_shapes;
  // Flagged plans: sources, the flags, then the landing buffers the arm
  // handed out (aliased to the results). Otherwise: sources only.
  const bool flagged = attrs.num_flags > 0;
  const size_t num_sources =
      flagged ? args.size() - std::min(args.size(), 1 + rets.size())
              : args.size();
  for (size_t i = 0; i < num_sources; ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    auto shape = ShapeOf(*b);
    if (!shape.has_value()) return shape.error();
    source_shapes.push_back(*shape);
    mine.sources.push_back(static_cast<const char*>(b->untyped_data()));
  }
  const char* flags = nullptr;
  if (flagged) {
    auto f = args.get<ffi::AnyBuffer>(num_sources);
    if (num_sources == 0 || args.size() != num_sources + 1 + rets.size() ||
        !f.has_value() || f->element_type() != ffi::DataType::S32 ||
        static_cast<int64_t>(f->element_count()) != attrs.num_flags) {
      return ffi::Error::InvalidArgument(
          "ficco peer copy start of '" + std::string(attrs.op_name) +
          "': a flagged start takes sources, one int32[" +
          std::to_string(attrs.num_flags) +
          "] flags buffer and its landing buffers, got " +
          std::to_string(args.size()) + " operands for " +
          std::to_string(rets.size()) + " results");
    }
    flags = static_cast<const char*>(f->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    auto shape = ShapeOf(**b);
    if (!shape.has_value()) return shape.error();
    landing_shapes.push_back(*shape);
    mine.landings.push_back(static_cast<char*>((*b)->untyped_data()));
  }
  auto plan_or = MakePlan(attrs, source_shapes, landing_shapes);
  if (!plan_or.has_value()) return plan_or.error();
  auto plan = std::make_shared<const Plan>(std::move(*plan_or));
  auto pos_or = Locate(*plan, device);
  if (!pos_or.has_value()) return pos_or.error();
  const Position pos = *pos_or;
  const std::string where = Where("start", *plan, device, pos);

  // Events come from this device's pool before joining, so a failure here
  // leaves the peers to time out rather than half-publishing a rank.
  {
    auto acquire = [&](typename Backend::Event** e) -> ffi::Error {
      auto ev = Backend::AcquireEvent(device);
      if (!ev.has_value()) return ev.error();
      *e = *ev;
      return ffi::Error::Success();
    };
    ffi::Error err = flagged ? TakeArmed<Backend>(run_id, device, *plan,
                                                  flags, &mine)
                             : acquire(&mine.ready);
    for (size_t i = 0; err.success() && i < plan->transfers.size(); ++i) {
      err = acquire(&mine.arrival.emplace_back(nullptr));
    }
    mine.stamps.assign(plan->transfers.size(), 0);
    if (flagged) {
      // Each flag some peer reads from: once it reaches the target (the
      // kernel, launched before this start, bumps it as it stores those
      // rows), its event fires; the peers' copies wait for that event.
      mine.piece_ready.assign(plan->num_flags, nullptr);
      for (int64_t f : plan->flags_used) {
        if (err.success()) err = acquire(&mine.piece_ready[f]);
        if (err.success()) {
          err = backend.FlagReady(
              device, f, reinterpret_cast<const int32_t*>(flags) + f,
              plan->flag_target, mine.ready, mine.piece_ready[f],
              plan->timeout_ms);
        }
      }
    } else if (err.success()) {
      // The sources are complete on the compute stream here, and the
      // landing buffers free.
      err = backend.RecordOnCompute(device, mine.ready);
    }
    if (err.failure()) {
      Inv::ReleaseEvents(mine);
      return ffi::Error(err.errc().value_or(ffi::ErrorCode::kInternal),
                        where + ": " + err.message());
    }
  }

  const Key key{run_id, plan->site, instance, pos.group,
                registry.NextSeq(device, run_id, plan->site, instance)};
  auto joined = registry.Join(key, plan, source_shapes[0].row_bytes, pos.rank);
  std::shared_ptr<Inv> inv = joined.inv;
  if (!joined.refused.empty()) {
    // The devices refuse starts after a stall (stall_breaker.h): this
    // execution fails here, and so do the peers that joined it.
    const std::string message = where + ": " + joined.refused;
    Inv::ReleaseEvents(mine);
    RefuseJoin(inv, message);
    return ffi::Error(ffi::ErrorCode::kAborted, message);
  }
  bool last = false;
  {
    std::unique_lock<std::mutex> lock(inv->mu);
    if (inv->abandoned) {
      // The peers gave up on this invocation: fail now rather than wait for
      // ranks that are gone.
      const bool forget = ++inv->arrived == ++inv->left;
      const std::string why = inv->failure;
      lock.unlock();
      Inv::ReleaseEvents(mine);
      if (forget) registry.Forget(key, inv.get());
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        where + ": arrived after its peers gave up (" + why +
                            ")");
    }
    inv->ranks[pos.rank] = std::move(mine);
    inv->ranks[pos.rank].arrived = true;
    last = ++inv->arrived == plan->axis_size;
  }
  inv->cv.notify_all();  // Parallel starts and issuers wait for arrivals.
  // wait and done of this device run after start returns (they consume its
  // outputs), so registering before the issue is early enough.
  registry.Register(device, run_id, inv, pos.rank);
  if (mode == kIssueAsync) {
    const int64_t rank = pos.rank;
    const int64_t timeout_ms = attrs.timeout_ms;
    IssuerOf<Backend>(device)
        .Push([backend, inv, key, rank, device, last, where,
               timeout_ms]() mutable {
          StartParallel(backend, inv, key, rank, device, last, where,
                        timeout_ms, /*async=*/true);
        });
    return ffi::Error::Success();
  }
  if (mode == kIssueParallel) {
    return StartParallel(backend, inv, key, pos.rank, device, last, where,
                         attrs.timeout_ms, /*async=*/false);
  }
  if (!last) return ffi::Error::Success();

  registry.Forget(key, inv.get());
  ffi::Error err = Issue(backend, inv);
  std::string message;
  if (err.failure()) {
    message = where + ": issuing the group's copies: " + err.message();
    inv->Fail(message);
  }
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(inv->mu);
    inv->issued = err.success();
    callbacks.swap(inv->on_issued);  // They check inv->failed().
  }
  inv->cv.notify_all();
  for (auto& callback : callbacks) callback();
  if (err.failure()) return ffi::Error(ffi::ErrorCode::kInternal, message);
  return ffi::Error::Success();
}

template <class Backend>
ffi::Error Start(Backend& backend, int64_t run_id, int64_t instance,
                 int32_t device,
                 ffi::RemainingArgs args, ffi::RemainingRets rets,
                 const Attrs& attrs) {
  const auto since = Clock::now();
  Trace(device, kTraceStartEnter, attrs.site);
  ffi::Error err = StartUntimed(backend, run_id, instance, device, args, rets,
                                attrs);
  if (err.failure()) {
    Registry<Backend>::Get().NoteFailure(device, run_id, err.message());
  }
  Registry<Backend>::Get().stats().Add(kStartTotal, since);
  Trace(device, kTraceStartExit, attrs.site);
  return err;
}

// The invocation a wait or done belongs to, and this device's rank in it.
template <class Backend>
struct Found {
  std::shared_ptr<Invocation<Backend>> inv;
  int64_t rank = 0;
  int64_t landing = 0;  // wait only
  std::string where;    // message prefix
};

template <class Backend>
ffi::ErrorOr<Found<Backend>> FindWait(int64_t run_id, int32_t device,
                                      const void* address,
                                      std::string_view op_name) {
  Found<Backend> f;
  if (!Registry<Backend>::Get().TakeWait(device, run_id, address, &f.inv,
                                         &f.landing)) {
    return ffi::Unexpected(ffi::Error(
        ffi::ErrorCode::kNotFound,
        "ficco peer copy wait of '" + std::string(op_name) + "' on device " +
            std::to_string(device) +
            ": no pending start of this execution lands in this buffer; pass"
            " each landing buffer of start, unchanged, to exactly one wait (a"
            " copy of it would read unfinished data)"));
  }
  while (f.inv->ranks[f.rank].device != device) ++f.rank;
  f.where = Where("wait", *f.inv->plan, device,
                  Position{f.inv->key.group, f.rank}) +
            ", landing buffer " + std::to_string(f.landing);
  return f;
}

template <class Backend>
ffi::ErrorOr<Found<Backend>> FindDone(int64_t run_id, int32_t device,
                                      const std::vector<const void*>& keepalive,
                                      std::string_view op_name) {
  const std::string head = "ficco peer copy done of '" + std::string(op_name) +
                           "' on device " + std::to_string(device);
  if (keepalive.empty()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(head + ": keepalive is empty"));
  }
  Found<Backend> f;
  if (!Registry<Backend>::Get().TakeDone(device, run_id, keepalive, &f.inv,
                                         &f.rank)) {
    return ffi::Unexpected(ffi::Error(
        ffi::ErrorCode::kNotFound,
        head + ": no pending start of this execution has keepalive[0] as"
               " sources[0] and its forwarded landing buffers (the outputs of"
               " their waits) in keepalive, or this done ran before its"
               " start: a sync that ends an invocation must read a buffer"
               " computed from that start's outputs (wait for one of its"
               " landing buffers in it, or keep alive an earlier wait's"
               " output), since XLA orders custom calls by data alone"));
  }
  f.where = Where("done", *f.inv->plan, device,
                  Position{f.inv->key.group, f.rank});
  return f;
}

// Why an invocation did not complete in time, at the deadline of a wait on
// it. Caller holds inv.mu. A timeout for ranks that never started also
// makes the group's devices refuse starts for a while (stall_breaker.h),
// unless a missing rank failed in a handler of this execution.
template <class Backend>
std::string StallFailure(const Invocation<Backend>& inv, int64_t timeout_ms) {
  const Plan& plan = *inv.plan;
  if (!inv.failure.empty()) return "a peer failed: " + inv.failure;
  auto& registry = Registry<Backend>::Get();
  const int64_t p = plan.axis_size;
  const std::vector<int64_t> group =
      Registry<Backend>::GroupOf(plan, inv.key.group);
  std::vector<int64_t> missing, missing_devices;
  std::string whereabouts;
  for (int64_t r = 0; r < p; ++r) {
    if (inv.ranks[r].arrived) continue;
    missing.push_back(r);
    missing_devices.push_back(group[r]);
    whereabouts += "; " + registry.Whereabouts(static_cast<int32_t>(group[r]),
                                               inv.key.run_id);
  }
  const std::string after = "timed out after " + std::to_string(timeout_ms) +
                            " ms ";
  if (missing.empty()) return after + "waiting for the copies to land";
  const std::string stall = after + "waiting for " +
                            RankList(missing, plan, inv.key.group) +
                            " to start" + whereabouts;
  registry.Stalled(group, missing_devices, inv.key.run_id,
                   "'" + plan.op_name + "' (site " + std::to_string(plan.site) +
                       ") of '" + plan.program + "' (execution " +
                       std::to_string(inv.key.run_id) + ") " + stall);
  return stall +
         ". A device that never reaches this op (an error, or another program"
         " there) stalls the whole group; " + kIfSeveralDispatchers;
}

// Failure path of wait and done: this device's execution aborts, so its rank
// leaves the invocation and drops its registrations. If the group never
// assembled, the invocation is abandoned, so late arrivers fail at once.
template <class Backend>
ffi::Error Abandon(const std::shared_ptr<Invocation<Backend>>& inv,
                   int64_t rank, int32_t device, const std::string& message) {
  std::vector<std::function<void()>> dropped;
  bool forget = false;
  {
    std::lock_guard<std::mutex> lock(inv->mu);
    if (!inv->issued) inv->abandoned = true;
    inv->FailLocked(message);
    // Pending waits of other ranks: run below, they see the failure and
    // fail fast (and they hold `inv`, a cycle until run).
    dropped.swap(inv->on_issued);
    if (!inv->ranks[rank].left) {
      inv->ranks[rank].left = true;
      ++inv->left;
    }
    forget = inv->abandoned && inv->left == inv->arrived;
  }
  inv->cv.notify_all();
  for (auto& callback : dropped) callback();
  auto& registry = Registry<Backend>::Get();
  // Noted first: a sibling sync of this execution that finds its entry
  // dropped then reports this failure.
  registry.NoteFailure(device, inv->key.run_id, message);
  registry.ForgetDevice(device, inv.get());
  if (forget) registry.Forget(inv->key, inv.get());
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, message);
}

template <class Backend>
void MarkLeft(Invocation<Backend>& inv, int64_t rank) {
  std::lock_guard<std::mutex> lock(inv.mu);
  if (!inv.ranks[rank].left) {
    inv.ranks[rank].left = true;
    ++inv.left;
  }
}

// Blocks (bounded) until the last rank has issued the group's copies, or
// the invocation failed; on failure or timeout this rank abandons it.
template <class Backend>
ffi::Error AwaitIssued(const Found<Backend>& f, int32_t device,
                       int64_t timeout_ms) {
  auto& inv = *f.inv;
  std::unique_lock<std::mutex> lock(inv.mu, std::defer_lock);
  SpinThenWait(lock, inv.cv, DeadlineAfter(timeout_ms),
               [&] { return inv.issued.load() || inv.failed(); });
  if (inv.issued && !inv.failed()) return ffi::Error::Success();
  const std::string message = f.where + ": " + StallFailure(inv, timeout_ms);
  lock.unlock();
  return Abandon(f.inv, f.rank, device, message);
}

// The buffers of one ficco_peer_copy_sync call, checked against its
// attributes: the landing buffers to wait for, and one keepalive group per
// invocation to end (docs/protocol.md, "Why start and sync").
struct SyncCall {
  std::vector<const void*> waits;
  std::vector<std::vector<const void*>> groups;
};

inline ffi::ErrorOr<SyncCall> DecodeSync(ffi::RemainingArgs args,
                                         ffi::RemainingRets rets,
                                         const Attrs& attrs) {
  const std::string head =
      "ficco peer copy sync of '" + std::string(attrs.op_name) + "'";
  const auto& bounds = attrs.keep_bounds;
  const int64_t num_outs = static_cast<int64_t>(rets.size());
  if (bounds.size() < 1 || bounds[0] != num_outs ||
      bounds[bounds.size() - 1] != static_cast<int64_t>(args.size()) ||
      attrs.num_wait < 0 || attrs.num_wait > num_outs) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        head + ": keep_bounds must start at the " + std::to_string(num_outs) +
        " outs and end at the " + std::to_string(args.size()) +
        " operands, and num_wait = " + std::to_string(attrs.num_wait) +
        " must not exceed the outs"));
  }
  SyncCall call;
  for (int64_t i = 0; i < num_outs; ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    if (!in.has_value()) return ffi::Unexpected(in.error());
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!out.has_value()) return ffi::Unexpected(out.error());
    if (in->untyped_data() != (*out)->untyped_data()) {
      return ffi::Unexpected(
          ffi::Error::Internal(head + ": out " + std::to_string(i) +
                               " is not aliased to its operand"));
    }
    if (i < attrs.num_wait) call.waits.push_back(in->untyped_data());
  }
  for (size_t g = 0; g + 1 < bounds.size(); ++g) {
    if (bounds[g + 1] <= bounds[g]) {
      return ffi::Unexpected(ffi::Error::InvalidArgument(
          head + ": keepalive group " + std::to_string(g) +
          " is empty or its bounds are out of order; each group needs at"
          " least the sources[0] given to start"));
    }
    auto& group = call.groups.emplace_back();
    for (int64_t i = bounds[g]; i < bounds[g + 1]; ++i) {
      auto b = args.get<ffi::AnyBuffer>(i);
      if (!b.has_value()) return ffi::Unexpected(b.error());
      group.push_back(b->untyped_data());
    }
  }
  return call;
}

// The transfers whose arrival events a wait on landing buffer `landing`
// awaits (every backend waits for the same ones).
inline std::vector<size_t> TransfersInto(const Plan& plan, int64_t landing) {
  std::vector<size_t> into;
  for (size_t i = 0; i < plan.transfers.size(); ++i) {
    if (plan.transfers[i].dst == landing) into.push_back(i);
  }
  return into;
}

// An event sync makes the compute stream wait for, and where it is recorded.
template <class Backend>
struct Awaited {
  typename Backend::Event* event;
  int32_t device;
  int64_t stream;
  uint64_t stamp;
};

// The arrivals into landing buffer `landing` of rank `rank`.
template <class Backend>
std::vector<Awaited<Backend>> LandingEvents(const Invocation<Backend>& inv,
                                            int64_t rank, int64_t landing) {
  std::vector<Awaited<Backend>> out;
  const auto& me = inv.ranks[rank];
  for (size_t i : TransfersInto(*inv.plan, landing)) {
    out.push_back({me.arrival[i], me.device, inv.plan->transfers[i].stream,
                   me.stamps[i]});
  }
  return out;
}

// The arrivals of every copy that reads rank `rank`'s buffers (its sources,
// or landing buffers it forwards): once they are complete, no peer reads
// what rank `rank` may hand back to XLA. Copies of other ranks that read
// elsewhere are not its concern (each rank's own landings are covered by its
// own waits).
template <class Backend>
std::vector<Awaited<Backend>> ReaderEvents(const Invocation<Backend>& inv,
                                           int64_t rank) {
  std::vector<Awaited<Backend>> out;
  const Plan& plan = *inv.plan;
  const int64_t p = plan.axis_size;
  for (int64_t q = 0; q < p; ++q) {
    if (q == rank) continue;
    const auto& reader = inv.ranks[q];
    for (size_t i = 0; i < plan.transfers.size(); ++i) {
      const Transfer& t = plan.transfers[i];
      if ((q + t.src_offset) % p != rank) continue;
      out.push_back({reader.arrival[i], reader.device, t.stream,
                     reader.stamps[i]});
    }
  }
  return out;
}

// sync for backends whose handler may block its thread (CUDA): the compute
// stream waits for every copy into each landing buffer and, per keepalive
// group, for every copy that reads this rank's buffers. Of the events on one
// copy queue only the newest is awaited (a queue runs in order): a direct
// reduce-scatter's sync enqueues 4 stream waits instead of 15.
//
// Every part is looked up (which unregisters it) before anything can fail,
// so a failing sync leaves none of its parts registered: each is abandoned.
template <class Backend>
ffi::Error BlockingSyncUntimed(Backend& backend, int64_t run_id,
                               int32_t device, const SyncCall& call,
                               const Attrs& attrs) {
  std::vector<Found<Backend>> parts;
  ffi::Error failure = ffi::Error::Success();
  auto keep = [&](auto&& f) {
    if (f.has_value()) {
      parts.push_back(std::move(*f));
    } else if (failure.success()) {
      failure = f.error();
    }
  };
  for (const void* address : call.waits) {
    keep(FindWait<Backend>(run_id, device, address, attrs.op_name));
  }
  const size_t found_waits = parts.size();
  for (const auto& group : call.groups) {
    keep(FindDone<Backend>(run_id, device, group, attrs.op_name));
  }
  auto abandon_all = [&](const std::string& why) {
    for (const auto& f : parts) {
      Abandon(f.inv, f.rank, device, f.where + ": " + why);
    }
  };
  if (failure.failure()) {
    abandon_all("another part of this sync failed: " + failure.message());
    return failure;
  }

  // With parallel issue each rank recorded its own arrival events before its
  // start returned, so a landing needs no host wait; a done reads peers'
  // events, recorded once the whole group is issued. Every other wait is
  // for the issue (bounded): no stream wait is ever enqueued before the copy
  // it waits for, whatever the mode. A CUDA wait on an unrecorded event is
  // a no-op, and waiting on the device for work not yet enqueued can
  // deadlock: streams share the device's few hardware queues in order, and
  // a driver call on an issuer thread may block until the device idles
  // (docs/protocol.md, "Three ways to issue").
  const int mode = Registry<Backend>::Get().mode().load(std::memory_order_relaxed);
  std::vector<Awaited<Backend>> events;
  for (size_t k = 0; k < parts.size(); ++k) {
    const auto& f = parts[k];
    const bool is_wait = k < found_waits;
    if (!is_wait || mode != kIssueParallel) {
      if (ffi::Error err = AwaitIssued(f, device, attrs.timeout_ms);
          err.failure()) {
        abandon_all("another part of this sync failed: " + err.message());
        return err;
      }
    }
    auto more = is_wait ? LandingEvents(*f.inv, f.rank, f.landing)
                        : ReaderEvents(*f.inv, f.rank);
    events.insert(events.end(), more.begin(), more.end());
  }
  Trace(device, kTraceSyncIssued, -1);
  // Newest event per (device, queue): a queue runs in order.
  std::map<std::pair<int32_t, int64_t>, Awaited<Backend>> newest;
  for (const auto& e : events) {
    auto [it, added] = newest.try_emplace({e.device, e.stream}, e);
    if (!added && e.stamp > it->second.stamp) it->second = e;
  }
  const auto since = Clock::now();
  for (const auto& [queue, e] : newest) {
    if (ffi::Error err = backend.WaitOnCompute(e.device, e.event); err.failure()) {
      abandon_all(err.message());
      return ffi::Error(err.errc().value_or(ffi::ErrorCode::kInternal),
                        parts.front().where + ": " + err.message());
    }
  }
  Registry<Backend>::Get().stats().Add(kSyncWaits, since,
                                       static_cast<int64_t>(newest.size()));
  for (size_t k = found_waits; k < parts.size(); ++k) {
    MarkLeft(*parts[k].inv, parts[k].rank);
  }
  return ffi::Error::Success();
}

template <class Backend>
ffi::Error BlockingSync(Backend& backend, int64_t run_id, int32_t device,
                        const SyncCall& call, const Attrs& attrs) {
  const auto since = Clock::now();
  Trace(device, kTraceSyncEnter, -1);
  ffi::Error err = BlockingSyncUntimed(backend, run_id, device, call, attrs);
  Registry<Backend>::Get().stats().Add(kSyncTotal, since);
  Trace(device, kTraceSyncExit, -1);
  return err;
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_PEER_COPY_PROTOCOL_H_
