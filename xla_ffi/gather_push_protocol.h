// The push all-gather matmul (docs/windows.md, "Push all-gather"), written
// once over the backend (backend.h; Gemm, gemm.h, is this protocol's).
//
// One call per op: out = all_gather(x) @ w. Each rank's copy engines push
// its shard x straight from XLA's buffer into every peer's window, and each
// arrival sets a flag there; the compute stream multiplies the own shard at
// once, then each peer's shard where it landed, behind a stream wait for
// that peer's flag (cuStreamWaitValue32), writing every product in place
// into its rows of the result. Nothing is staged, no host thread waits for
// a peer (only, rarely, for one two calls behind or not yet at this op), and
// nothing crosses devices but the copies and the flags.
//
// The window (a pooled push window, shared with the flagged reduce-scatter)
// holds two halves of P - 1 landing shards: epoch e lands in half e % 2, the
// shard of the peer s ranks before this one at index s - 1. Its header's
// ready[q] and freed[q] mean what they mean for the push protocol
// (push_protocol.h), so its watchdog, failure and pooling rules hold here.

#ifndef FICCO_XLA_FFI_GATHER_PUSH_PROTOCOL_H_
#define FICCO_XLA_FFI_GATHER_PUSH_PROTOCOL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gemm.h"
#include "push_ident.h"
#include "push_protocol.h"
#include "window.h"
#include "window_protocol.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

// ficco_push_gather: enqueue the pushes of x, the own GEMM, and per peer the
// wait for its shard and its GEMM, then the freed flags; returns the
// invocation (the caller awaits or watches it). `gathered` is empty, or
// [P m, k] of x's type: then every shard is also copied into it, rank q's
// at rows [q m, + m) (the gradient's residual, so that dw needs no second
// gather), on the push queue as each lands, off the compute stream.
// A failure once the pushes may be enqueued also sets `*drain` to the
// invocation: its queues may still read x and write out and gathered, XLA's
// buffers, some of it behind a peer's flag, so the caller drains it before
// the error reaches XLA, as a failing done does (cuda_window.cu,
// FailDrained; cpu_window.cc, FailSettled).
template <class B>
ffi::ErrorOr<std::shared_ptr<WindowInvocation<B>>> PushGather(
    B& backend, int64_t run_id, int64_t instance, int32_t device,
    ffi::AnyBuffer x,
    ffi::AnyBuffer w, ffi::AnyBuffer out, ffi::AnyBuffer gathered,
    const Attrs& a, std::shared_ptr<WindowInvocation<B>>* drain) {
  using Inv = WindowInvocation<B>;
  auto who = [&] { return PushWho("all-gather", a.op_name, device); };
  auto failed = [](ffi::Error err) { return ffi::Unexpected(std::move(err)); };
  // The never-arrive hook: this rank does nothing, its peers time out.
  auto found = UsableWindow<B>(a.window, device, who, kFaultStart);
  if (!found.has_value()) return failed(found.error());
  std::shared_ptr<Window> win = *found;
  // Until every operation of this call is enqueued, in epoch order.
  auto issue = IssueLock(*win, a.timeout_ms);
  if (ffi::Error err = CheckIssueLock(issue, *win, a.timeout_ms, who());
      err.failure()) {
    return failed(std::move(err));
  }
  if (PushStates<B>::Get().HasStarted(a.window, device)) {
    // A flagged reduce-scatter's start on this window never reached its
    // finish: an execution failed between them, another thread's program
    // is between them, or two push ops of one site (or of one pooled
    // window) overlap in this execution.
    const std::string why =
        who() + ": a push start of window " + std::to_string(a.window) +
        " on this device never reached its finish: " + kStartUnfinished;
    Windows::Get().PoisonFamily(B::kPlatform, a.window, why);
    return failed(ffi::Error(ffi::ErrorCode::kFailedPrecondition, why));
  }
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto od = out.dimensions();
  const int64_t size = win->size, me = win->rank;
  const int64_t elem = static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2 || xd[1] != wd[0] ||
      od[0] != size * xd[0] || od[1] != wd[1] ||
      x.element_type() != w.element_type() || elem == 0) {
    auto dims = [](auto d) {
      std::string s = "[";
      for (size_t i = 0; i < d.size(); ++i) {
        s += (i ? ", " : "") + std::to_string(d[i]);
      }
      return s + "]";
    };
    return failed(ffi::Error::InvalidArgument(
        who() + ": needs x [m, k], w [k, n] of one element type and a result"
        " [" + std::to_string(size) + " m, n], got x " + dims(xd) + ", w " +
        dims(wd) + ", result " + dims(od)));
  }
  if (ffi::Error err = CheckGemmTypes(x.element_type(), out.element_type(),
                                      who());
      err.failure()) {
    return failed(std::move(err));
  }
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  auto gd = gathered.dimensions();
  const bool keep = gathered.element_count() > 0;
  if (keep && (gd.size() != 2 || gd[0] != size * m || gd[1] != k ||
               gathered.element_type() != x.element_type())) {
    return failed(ffi::Error::InvalidArgument(
        who() + ": the gathered result must be empty or [" +
        std::to_string(size * m) + ", " + std::to_string(k) + "] of x's"
        " element type"));
  }
  const int64_t rb = k * elem;
  const int64_t out_row_bytes =
      n * static_cast<int64_t>(ffi::ByteWidth(out.element_type()));
  if ((size - 1) * m * rb > a.half_bytes || 2 * a.half_bytes > win->slot_bytes) {
    return failed(ffi::Error::InvalidArgument(
        who() + ": " + std::to_string(size - 1) + " shards of " +
        std::to_string(m * rb) + " bytes must fit a half of " +
        std::to_string(a.half_bytes) + " bytes, two of which fit the"
        " window's slot of " + std::to_string(win->slot_bytes)));
  }

  auto inv = std::make_shared<Inv>();
  inv->win = win;
  inv->plan.op_name = std::string(a.op_name);
  inv->plan.axis_size = size;
  inv->plan.timeout_ms = a.timeout_ms;
  const uint32_t e = win->epoch.fetch_add(1) + 1;
  const uint32_t ident = PushIdent(a);
  inv->epoch = e;
  inv->freed_lag = 2;  // The landing halves.
  inv->where = PushWhere("all-gather", a.op_name, *win, e);
  // A drained failure fails the window starts of this execution with it
  // (WindowIndex::FailRun): their waits and dones will never come.
  inv->run_id = run_id;
  auto fail = [&](ffi::Error err) {
    inv->Fail(inv->where + ": " + std::string(err.message()));
    return ffi::Unexpected(std::move(err));
  };
  // From the pushes on (`*drain`): `staged` too is recorded again, since
  // the push queue may have stopped short of this invocation's own record.
  auto fail_drained = [&](ffi::Error err) {
    *drain = inv;
    return ffi::Unexpected(PushFailDrained(backend, inv, device,
                                           std::move(err),
                                           /*restage=*/true));
  };
  // The pooled window is shared by programs: pairing two of them at one
  // epoch would multiply one's shards into the other's result.
  if (ffi::Error err = CheckEpochRun(B::kPlatform, *win, e, run_id,
                                     inv->where, instance);
      err.failure()) {
    return ffi::Unexpected(std::move(err));
  }
  for (auto* slot : {&inv->ready, &inv->staged, &inv->signalled}) {
    auto ev = B::AcquireEvent(device);
    if (!ev.has_value()) return fail(ev.error());
    *slot = *ev;
  }
  if (ffi::Error err = backend.RecordOnCompute(device, inv->ready);
      err.failure()) {
    return fail(std::move(err));
  }

  // Half e % 2 of a peer was last read in epoch e - 2: its freed flag, whose
  // writer must be enqueued before the wait is (docs/windows.md, "Why the
  // host orders the waits"); it is, unless this rank is two calls ahead.
  if constexpr (B::kHostOrdered) {
    for (int64_t t = 0; e > 2 && t < size; ++t) {
      if (t == me) continue;
      if (ffi::Error err = HostWait(*win, t, kAllEnqueued, e - 2,
                                    a.timeout_ms, inv->where);
          err.failure()) {
        return fail(std::move(err));
      }
    }
  }
  const char* src = static_cast<const char*>(x.untyped_data());
  auto push = [&]() -> ffi::Error {
    FICCO_RETURN_IF_FAILED(
        backend.WaitEvent(inv, device, kPushQueue, inv->ready));
    std::vector<FlagOp> ops;
    for (int64_t t = 0; e > 2 && t < size; ++t) {
      if (t == me) continue;
      ops.push_back({false, win->FreedOf(win->base, t), e - 2,
                     WaitName<B>([&] {
                       return RankName(*win, t) + " to finish reading epoch " +
                              std::to_string(e - 2);
                     })});
    }
    if constexpr (!B::kHostOrdered) {
      FICCO_RETURN_IF_FAILED(backend.FlagOps(inv, device, kPushQueue, ops));
      ops.clear();
    }
    FICCO_RETURN_IF_FAILED(
        PublishIdentAfterFreed(backend, inv, device, kPushQueue, ident));
    // Nearest peer first: it is the one whose GEMM comes first.
    for (int64_t s = 1; s < size; ++s) {
      const int64_t t = (me + s) % size;
      FICCO_RETURN_IF_FAILED(backend.FlagOps(inv, device, kPushQueue, ops));
      ops.clear();
      FICCO_RETURN_IF_FAILED(backend.Copy(
          inv, device, kPushQueue,
          PushHalf(*win, win->peers[t], e) + (s - 1) * m * rb, src,
          static_cast<size_t>(m * rb)));
      ops.push_back({true, win->ReadyOf(win->peers[t], me), e, ""});
    }
    return backend.FlagOps(inv, device, kPushQueue, ops);
  };
  if (ffi::Error err = push(); err.failure()) {
    return fail_drained(std::move(err));
  }
  HostPublish(*win, kStagedEnqueued, e);
  // The fault hook's wait step: a rank that fails once its pushes are
  // queued, so that a test reaches fail_drained (tests/test_faults.py).
  if (Faults(device, kFaultWait)) {
    return fail_drained(ffi::Error(
        ffi::ErrorCode::kUnavailable,
        who() + ": refused by the fault test hook (wait)"));
  }

  const int64_t queue = B::kComputeQueue;
  char* dst = static_cast<char*>(out.untyped_data());
  auto gemm = [&](const char* rows, int64_t rank) {
    return backend.Gemm(inv, device, queue,
                        GemmArgs{x.element_type(), out.element_type(), rows,
                                 static_cast<const char*>(w.untyped_data()),
                                 dst + rank * m * out_row_bytes, m, k, n, n});
  };
  // The own shard needs no peer: its GEMM goes first, before any host wait.
  if (ffi::Error err = gemm(src, me); err.failure()) {
    return fail_drained(std::move(err));
  }
  if constexpr (B::kHostOrdered) {
    // The peers' pushes of epoch e, whose ready flags the compute stream is
    // about to wait on, must be enqueued.
    for (int64_t q = 0; q < size; ++q) {
      if (q == me) continue;
      ffi::Error err = HostWait(*win, q, kStagedEnqueued, e, a.timeout_ms,
                                inv->where);
      // Its shard is about to be multiplied: it must be this op's.
      if (err.success()) err = CheckIdentOnHost(*inv, q, ident);
      if (err.failure()) return fail_drained(std::move(err));
    }
  }
  // On queue `on`, per peer in push order: wait until its shard of epoch e
  // has landed in this window, then `use` it (where it landed, its rank).
  const char* landed = PushHalf(*win, win->base, e);
  auto each_landed = [&](int64_t on, const char* why,
                         auto&& use) -> ffi::Error {
    if constexpr (!B::kHostOrdered) {
      FICCO_RETURN_IF_FAILED(
          CheckIdentsInLane(backend, inv, device, on, ident));
    }
    for (int64_t s = 1; s < size; ++s) {
      const int64_t q = (me - s + size) % size;
      FICCO_RETURN_IF_FAILED(backend.FlagOps(
          inv, device, on,
          {{false, win->ReadyOf(win->base, q), e, WaitName<B>([&] {
              return RankName(*win, q) + " to push epoch " +
                     std::to_string(e) + why;
            })}}));
      FICCO_RETURN_IF_FAILED(use(landed + (s - 1) * m * rb, q));
    }
    return ffi::Error::Success();
  };
  // `staged` follows the pushes and, when kept, the copies into `gathered`:
  // the compute stream waits for it before the halves are released. The
  // copies' waits for the peers' ready flags come after the host wait
  // above, as the compute stream's do (the host order).
  auto copy_out = [&]() -> ffi::Error {
    if (keep) {
      char* g = static_cast<char*>(gathered.untyped_data());
      auto copy = [&](const char* rows, int64_t rank) {
        return backend.Copy(inv, device, kPushQueue, g + rank * m * rb, rows,
                            static_cast<size_t>(m * rb));
      };
      FICCO_RETURN_IF_FAILED(copy(src, me));
      FICCO_RETURN_IF_FAILED(
          each_landed(kPushQueue, " (the gathered copy)", copy));
    }
    return backend.Record(inv, device, kPushQueue, inv->staged);
  };
  if (ffi::Error err = copy_out(); err.failure()) {
    return fail_drained(std::move(err));
  }
  auto consume = [&]() -> ffi::Error {
    FICCO_RETURN_IF_FAILED(each_landed(queue, "", gemm));
    // This rank's pushes read x, which XLA may reuse after this call.
    FICCO_RETURN_IF_FAILED(backend.WaitEvent(inv, device, queue, inv->staged));
    return PushRelease(backend, inv, device, queue);
  };
  if (ffi::Error err = consume(); err.failure()) {
    return fail_drained(std::move(err));
  }
  HostPublish(*win, kAllEnqueued, e);
  return inv;
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_GATHER_PUSH_PROTOCOL_H_
