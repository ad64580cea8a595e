// The push protocol of the flagged reduce-scatter (docs/windows.md,
// "Push"), written once over the backend (backend.h).
//
// Each rank's copy engines push its partials straight from XLA's buffer
// into the owning rank's window, each piece as soon as the kernel's flag
// says it is written, and the owner adds them to its own rows from there:
// no host rendezvous per call and no staging copy. Three calls per op:
//
//   flags, rank = ficco_push_arm()                 # before the kernel
//   parts, flags = kernel(h, w, flags, rank)        # bumps flags[i]
//   flags = ficco_push_start(parts, flags)          # aliased
//   out = ficco_push_finish(parts, flags)           # own rows + landed
//
// The window's slot holds two halves of landing pieces; epoch e lands in
// half e % 2, so a push of epoch e waits for the owner to have read epoch
// e - 2 (its freed flag), which it almost always has.
//
// The backend's Sum (out chunk c = own chunk c + the peers' pieces of chunk
// c, landing piece c * peers + k, in k order, accumulated in f32, f64 for
// f64) and FlagOps (WaitFlag/WriteFlag of each op in order; CUDA: one
// driver call) are this protocol's (backend.h).

#ifndef FICCO_XLA_FFI_PUSH_PROTOCOL_H_
#define FICCO_XLA_FFI_PUSH_PROTOCOL_H_

#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "peer_copy_protocol.h"  // ShapeOf
#include "push_ident.h"
#include "window.h"
#include "window_protocol.h"     // WindowInvocation, HostWait, HostPublish
#include "xla/ffi/api/ffi.h"

namespace ficco {

// One flag operation of a batch (Backend::FlagOps): wait until *addr >=
// value (cyclic), or write value into *addr after the queue's earlier work.
struct FlagOp {
  bool write;
  uint32_t* addr;
  uint32_t value;
  std::string who;  // a wait's: whom it waits for, for timeout messages
};


// What an arm hands to its start, and a start to its finish, per window and
// device (a window's runs are sequential on a device).
template <class B>
class PushStates {
 public:
  using Inv = WindowInvocation<B>;
  struct Armed {
    const void* flags = nullptr;
    typename B::Event* ready = nullptr;
    int64_t run_id = 0;
  };
  static PushStates& Get() {
    static PushStates* s = new PushStates();  // Leaked: handlers may run at exit.
    return *s;
  }
  // False, changing nothing, if an arm of the same execution is still
  // waiting for its start: the site runs twice at once (kRunsTwice).
  bool PutArmed(int64_t family, int32_t device, Armed a) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = armed_[{family, device}];
    if (slot.ready != nullptr && slot.run_id == a.run_id) return false;
    // An aborted execution's arm: its event goes back to the pool.
    if (slot.ready != nullptr) B::ReleaseEvent(device, slot.ready);
    slot = a;
    return true;
  }
  bool TakeArmed(int64_t family, int32_t device, Armed* a) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = armed_.find({family, device});
    if (it == armed_.end() || it->second.ready == nullptr) return false;
    *a = it->second;
    it->second = Armed{};
    return true;
  }
  void PutStarted(int64_t family, int32_t device, std::shared_ptr<Inv> inv) {
    std::lock_guard<std::mutex> lock(mu_);
    started_[{family, device}] = std::move(inv);
  }
  bool HasStarted(int64_t family, int32_t device) {
    std::lock_guard<std::mutex> lock(mu_);
    return started_.count({family, device}) != 0;
  }
  std::shared_ptr<Inv> TakeStarted(int64_t family, int32_t device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = started_.find({family, device});
    if (it == started_.end()) return nullptr;
    std::shared_ptr<Inv> inv = std::move(it->second);
    started_.erase(it);
    return inv;
  }
  // Drops every entry of an abandoned family (its armed events go back to
  // the pool; a started invocation releases its own when dropped).
  void Forget(int64_t family) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = armed_.begin(); it != armed_.end();) {
      if (std::get<0>(it->first) != family) { ++it; continue; }
      if (it->second.ready != nullptr) {
        B::ReleaseEvent(std::get<1>(it->first), it->second.ready);
      }
      it = armed_.erase(it);
    }
    for (auto it = started_.begin(); it != started_.end();) {
      it = std::get<0>(it->first) == family ? started_.erase(it) : std::next(it);
    }
  }
  int64_t Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = static_cast<int64_t>(started_.size());
    for (const auto& [key, a] : armed_) n += a.ready != nullptr;
    return n;
  }

 private:
  using Key = std::tuple<int64_t, int32_t>;
  std::mutex mu_;
  std::map<Key, Armed> armed_;
  std::map<Key, std::shared_ptr<Inv>> started_;
};

inline std::string PushWhere(std::string_view phase, std::string_view op,
                             const Window& w, uint32_t epoch) {
  return "ficco push " + std::string(phase) + " of '" + std::string(op) +
         "' (window " + std::to_string(w.family) + ", epoch " +
         std::to_string(epoch) + ") on device " + std::to_string(w.device) +
         " (rank " + std::to_string(w.rank) + " of " + std::to_string(w.size) +
         ")";
}

// A wait's description, for the backends whose waits time out with a
// message (B::kNamesWaits: the CPU twin's queues); CUDA's watchdog names
// late ranks from the flags instead, so its hot path builds no strings.
template <class B, class Make>
std::string WaitName(Make make) {
  if constexpr (B::kNamesWaits) {
    return make();
  } else {
    return std::string();
  }
}

// "ficco push start of 'op' on device 2", for errors before an epoch.
inline std::string PushWho(std::string_view phase, std::string_view op,
                           int32_t device) {
  return "ficco push " + std::string(phase) + " of '" + std::string(op) +
         "' on device " + std::to_string(device);
}

// Landing half of epoch e in a window.
inline char* PushHalf(const Window& w, char* window, uint32_t e) {
  // At the slot's midpoint, not at the op's own half size: programs of
  // different sizes share a pooled window (windows.pooled_family), and a
  // push of epoch e must never land where a peer still reads epoch e - 1.
  return w.Slot(window, e) + static_cast<int64_t>(e % 2) * (w.slot_bytes / 2);
}


// The end of a push op on `queue`, once this rank has read every peer's
// pieces of the invocation's epoch: tell the peers (freed[rank] = epoch in
// their windows: they may push into that half again) and record
// `signalled`.
template <class B>
ffi::Error PushRelease(B& backend,
                       const std::shared_ptr<WindowInvocation<B>>& inv,
                       int32_t device, int64_t queue) {
  const Window& win = *inv->win;
  std::vector<FlagOp> ops;
  for (int64_t q = 0; q < win.size; ++q) {
    if (q != win.rank) {
      ops.push_back({true, win.FreedOf(win.peers[q], win.rank), inv->epoch, ""});
    }
  }
  FICCO_RETURN_IF_FAILED(backend.FlagOps(inv, device, queue, ops));
  return backend.Record(inv, device, queue, inv->signalled);
}

// A push invocation that fails once its copies may be enqueued: its queues
// may still read XLA's buffers and write the peers' windows and its result,
// some of it behind a peer's flag, so the caller drains it before the error
// reaches XLA, as a failing done does (cuda_window.cu, FailDrained;
// cpu_window.cc, FailSettled). Failed first: on the CPU twin the queued
// work is then skipped, so the queues drain at once. `signalled` is
// recorded again after whatever the compute stream holds, and, with
// `restage` (the pushes may have stopped short of their own record of it),
// `staged` after whatever the push queue holds, so that waiting for every
// event of the invocation, and the watchdog's polling of those two, covers
// it all; best effort, since the queue may be what failed. The issue is
// over (AwaitIssued). Returns `err`.
template <class B>
ffi::Error PushFailDrained(B& backend,
                           const std::shared_ptr<WindowInvocation<B>>& inv,
                           int32_t device, ffi::Error err, bool restage) {
  inv->Fail(inv->where + ": " + std::string(err.message()));
  if (restage) (void)backend.Record(inv, device, kPushQueue, inv->staged);
  (void)backend.Record(inv, device, B::kComputeQueue, inv->signalled);
  {
    std::lock_guard<std::mutex> lock(inv->mu);
    inv->issue_error = err;
  }
  inv->issue_state.store(kIssueFailed, std::memory_order_release);
  return err;
}

// ficco_push_arm: zero the flags, write the rank, record the event after
// which the flags are zero, for this window's next start on this device.
template <class B>
ffi::Error PushArm(B& backend, int64_t run_id, int32_t device,
                   ffi::AnyBuffer flags, ffi::AnyBuffer rank,
                   const Attrs& attrs) {
  auto win = UsableWindow<B>(attrs.window, device, [&] {
    return PushWho("arm", attrs.op_name, device);
  });
  if (!win.has_value()) return win.error();
  if (flags.element_type() != ffi::DataType::S32 ||
      rank.element_type() != ffi::DataType::S32 || rank.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "ficco push arm of '" + std::string(attrs.op_name) +
        "': results must be flags int32[n] and rank int32[]");
  }
  FICCO_RETURN_IF_FAILED(
      backend.ZeroOnCompute(static_cast<char*>(flags.untyped_data()),
                            flags.size_bytes()));
  FICCO_RETURN_IF_FAILED(backend.SetInt32OnCompute(
      static_cast<char*>(rank.untyped_data()),
      static_cast<int32_t>((*win)->rank)));
  auto ev = B::AcquireEvent(device);
  if (!ev.has_value()) return ev.error();
  if (auto err = backend.RecordOnCompute(device, *ev); err.failure()) {
    B::ReleaseEvent(device, *ev);
    return err;
  }
  if (!PushStates<B>::Get().PutArmed(attrs.window, device,
                                     {flags.untyped_data(), *ev, run_id})) {
    B::ReleaseEvent(device, *ev);
    const std::string why = PushWho("arm", attrs.op_name, device) +
                            ": its previous arm in this execution has not" +
                            " reached its start; " + kRunsTwice;
    // Every device's window of the family: the peers' calls of this site
    // fail with this message rather than a timeout's (on CPU at once).
    Windows::Get().PoisonFamily(B::kPlatform, attrs.window, why);
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, why);
  }
  return ffi::Error::Success();
}

// ficco_push_start: enqueue every push of this rank on its push queue.
// Piece i (attrs' copy table): rows [src_row[i], + rows[i]) of the kernel's
// result go to rank (rank + shift[i]) % P, at row dst_row[i] of its landing
// half (half_bytes), once flags[src_flag[i]] >= flag_target.
// A failure once the pushes may be enqueued also sets `*drain` to the
// invocation: they may still read parts, XLA's buffer, behind the kernel's
// flags and the peers' freed flags, so the caller drains it before the
// error reaches XLA (PushFailDrained).
template <class B>
ffi::Error PushStart(B& backend, int64_t run_id, int64_t instance,
                     int32_t device,
                     ffi::AnyBuffer parts, ffi::AnyBuffer flags,
                     const Attrs& a,
                     std::shared_ptr<WindowInvocation<B>>* drain) {
  using Inv = WindowInvocation<B>;
  auto who = [&] { return PushWho("start", a.op_name, device); };
  auto found = UsableWindow<B>(a.window, device, who, kFaultWait);
  if (!found.has_value()) return found.error();
  std::shared_ptr<Window> win = *found;
  // Until the pushes and their flags are enqueued, in epoch order.
  auto issue = IssueLock(*win, a.timeout_ms);
  FICCO_RETURN_IF_FAILED(CheckIssueLock(issue, *win, a.timeout_ms, who()));
  if (PushStates<B>::Get().HasStarted(a.window, device)) {
    // Its finish never ran: an execution failed between them, another
    // thread's program is between them, or one traced op runs twice at
    // once in a program (docs/protocol.md, "Several runs of one site").
    // Either way the ranks' epochs may now disagree.
    const std::string why =
        who() + ": the previous start of window " + std::to_string(a.window) +
        " on this device never reached its finish: " + kStartUnfinished;
    // Every device's window of the family, as a refused arm does: the
    // peers' calls fail with this message at once, not at their timeout.
    Windows::Get().PoisonFamily(B::kPlatform, a.window, why);
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, why);
  }
  typename PushStates<B>::Armed armed;
  if (!PushStates<B>::Get().TakeArmed(a.window, device, &armed)) {
    // Its arm ran (the program orders them), so another execution's start
    // took it: the peers take an epoch for this call that this rank will
    // not, and would pair every later one with the wrong call.
    const std::string why =
        who() + ": no ficco_push_arm of this window is left for it on this"
        " device: another execution's start took this execution's arm; " +
        kIfSeveralDispatchers;
    Windows::Get().PoisonFamily(B::kPlatform, a.window, why);
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, why);
  }
  auto inv = std::make_shared<Inv>();
  inv->win = win;
  inv->ready = armed.ready;  // Released with the invocation from now on.
  if (armed.run_id != run_id) {
    // Another execution armed the window after this one did: two programs
    // that share it run on this device at once, and that one's kernel
    // bumps other flags than this start would wait on.
    const std::string why =
        who() + ": another execution armed this window on this device"
        " between this execution's arm and start; " + kIfSeveralDispatchers;
    Windows::Get().PoisonFamily(B::kPlatform, a.window, why);
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, why);
  }
  inv->plan.op_name = std::string(a.op_name);
  inv->plan.axis_size = win->size;
  inv->plan.timeout_ms = a.timeout_ms;
  // CUDA: the copy engines wait on the flags the kernel bumps in place; a
  // copy XLA inserted would never be bumped (the CPU twin runs after the
  // kernel, so any copy holds the final counts).
  if (B::kFlagsMustAlias && armed.flags != flags.untyped_data()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      who() + ": the flags differ from those ficco_push_arm"
                      " zeroed: XLA copied them in between");
  }
  auto shape = ShapeOf(parts);
  if (!shape.has_value()) return shape.error();
  const int64_t rb = shape->row_bytes, size = win->size, me = win->rank;
  const size_t n = a.shift.size();
  if (n == 0 || a.src_row.size() != n || a.dst_row.size() != n ||
      a.rows.size() != n || a.src_flag.size() != n) {
    return ffi::Error::InvalidArgument(
        who() + ": shift, src_row, dst_row, rows and src_flag must have one"
        " entry per piece, got " + std::to_string(n) + ", " +
        std::to_string(a.src_row.size()) + ", " +
        std::to_string(a.dst_row.size()) + ", " +
        std::to_string(a.rows.size()) + ", " +
        std::to_string(a.src_flag.size()));
  }
  if (2 * a.half_bytes > win->slot_bytes) {
    return ffi::Error::InvalidArgument(
        who() + ": two landing halves of " + std::to_string(a.half_bytes) +
        " bytes exceed the window's slot of " + std::to_string(win->slot_bytes));
  }
  const int64_t num_flags = static_cast<int64_t>(flags.element_count());
  std::vector<int64_t> last_to(size, -1);  // last piece to each rank
  for (size_t i = 0; i < n; ++i) {
    if (a.shift[i] < 1 || a.shift[i] >= size || a.rows[i] < 1 ||
        a.src_row[i] < 0 || a.src_row[i] + a.rows[i] > shape->rows ||
        a.dst_row[i] < 0 || (a.dst_row[i] + a.rows[i]) * rb > a.half_bytes ||
        a.src_flag[i] < 0 || a.src_flag[i] >= num_flags) {
      return ffi::Error::InvalidArgument(
          who() + ": piece " + std::to_string(i) + " (shift " +
          std::to_string(a.shift[i]) + ", rows [" +
          std::to_string(a.src_row[i]) + ", +" + std::to_string(a.rows[i]) +
          ") to row " + std::to_string(a.dst_row[i]) + ", flag " +
          std::to_string(a.src_flag[i]) + ") is out of range for " +
          std::to_string(size) + " ranks, " + std::to_string(shape->rows) +
          " source rows, a half of " + std::to_string(a.half_bytes / rb) +
          " rows and " + std::to_string(num_flags) + " flags");
    }
    last_to[(me + a.shift[i]) % size] = static_cast<int64_t>(i);
  }

  const uint32_t e = win->epoch.fetch_add(1) + 1;
  const uint32_t ident = PushIdent(a);
  inv->epoch = e;
  inv->freed_lag = 2;  // The landing halves.
  inv->where = PushWhere("start", a.op_name, *win, e);
  // A drained failure, of this start or of its finish, fails the window
  // starts of this execution with it (WindowIndex::FailRun): their waits
  // and dones will never come.
  inv->run_id = run_id;
  // The pooled window is shared by programs: pairing two of them at one
  // epoch would add one's partials to the other's result.
  FICCO_RETURN_IF_FAILED(
      CheckEpochRun(B::kPlatform, *win, e, run_id, inv->where, instance));
  auto fail = [&](ffi::Error err) {
    inv->Fail(inv->where + ": " + std::string(err.message()));
    return err;
  };
  auto staged = B::AcquireEvent(device);
  if (!staged.has_value()) return fail(staged.error());
  inv->staged = *staged;
  auto signalled = B::AcquireEvent(device);
  if (!signalled.has_value()) return fail(signalled.error());
  inv->signalled = *signalled;

  // Half e % 2 of a receiver was last read in epoch e - 2: its freed flag.
  if constexpr (B::kHostOrdered) {
    // Enqueue that wait only after its writer (the receiver's finish of e - 2)
    // has been enqueued (docs/windows.md, "Why the host orders the waits"):
    // it has, unless this rank is two calls ahead of a peer.
    for (int64_t t = 0; e > 2 && t < size; ++t) {
      if (last_to[t] < 0) continue;
      if (auto err = HostWait(*win, t, kAllEnqueued, e - 2, a.timeout_ms,
                              inv->where);
          err.failure()) {
        return fail(std::move(err));
      }
    }
  }
  auto run = [&]() -> ffi::Error {
    FICCO_RETURN_IF_FAILED(
        backend.WaitEvent(inv, device, kPushQueue, inv->ready));
    // Flag operations between two copies go in one batch: each driver call
    // is host time on a host-bound op's critical path.
    std::vector<FlagOp> ops;
    auto flush = [&]() -> ffi::Error {
      ffi::Error err = backend.FlagOps(inv, device, kPushQueue, ops);
      ops.clear();
      return err;
    };
    for (int64_t t = 0; e > 2 && t < size; ++t) {
      if (last_to[t] < 0) continue;
      ops.push_back({false, win->FreedOf(win->base, t), e - 2,
                     WaitName<B>([&] {
                       return RankName(*win, t) + " to finish reading epoch " +
                              std::to_string(e - 2);
                     })});
    }
    if constexpr (!B::kHostOrdered) FICCO_RETURN_IF_FAILED(flush());
    FICCO_RETURN_IF_FAILED(
        PublishIdentAfterFreed(backend, inv, device, kPushQueue, ident));
    const char* src = static_cast<const char*>(parts.untyped_data());
    uint32_t* flag_words = static_cast<uint32_t*>(flags.untyped_data());
    int64_t waited_flag = -1;
    for (size_t i = 0; i < n; ++i) {
      const int64_t t = (me + a.shift[i]) % size;
      if (a.src_flag[i] != waited_flag) {
        waited_flag = a.src_flag[i];
        ops.push_back({false, flag_words + a.src_flag[i],
                       static_cast<uint32_t>(a.flag_target), WaitName<B>([&] {
                         return "the kernel to write piece " +
                                std::to_string(i);
                       })});
      }
      FICCO_RETURN_IF_FAILED(flush());
      FICCO_RETURN_IF_FAILED(backend.Copy(
          inv, device, kPushQueue,
          PushHalf(*win, win->peers[t], e) + a.dst_row[i] * rb,
          src + a.src_row[i] * rb, static_cast<size_t>(a.rows[i] * rb)));
      if (last_to[t] == static_cast<int64_t>(i)) {
        ops.push_back({true, win->ReadyOf(win->peers[t], me), e, ""});
      }
    }
    FICCO_RETURN_IF_FAILED(flush());
    return backend.Record(inv, device, kPushQueue, inv->staged);
  };
  if (auto err = run(); err.failure()) {
    *drain = inv;
    return PushFailDrained(backend, inv, device, std::move(err),
                           /*restage=*/true);
  }
  HostPublish(*win, kStagedEnqueued, e);
  PushStates<B>::Get().PutStarted(a.window, device, inv);
  return ffi::Error::Success();
}

// ficco_push_finish: enqueue, on the compute queue, the waits for every
// peer's pieces and for this rank's own pushes, the sum into `out`, and the
// freed flags; returns the invocation (the caller awaits or watches it).
// Its result: rows [own_row, + num_chunks * chunk_rows) of the kernel's
// result plus the landed pieces, chunk-major, P - 1 per chunk in shift order.
// A failure once it holds its start's invocation also sets `*drain` to it:
// the start's pushes may still read parts, and this rank's sum write out,
// XLA's buffers, behind the kernel's and the peers' flags, so the caller
// drains it before the error reaches XLA (PushFailDrained).
template <class B>
ffi::ErrorOr<std::shared_ptr<WindowInvocation<B>>> PushFinish(
    B& backend, int32_t device, ffi::AnyBuffer parts, ffi::AnyBuffer out,
    const Attrs& a, std::shared_ptr<WindowInvocation<B>>* drain) {
  using Inv = WindowInvocation<B>;
  auto who = [&] { return PushWho("finish", a.op_name, device); };
  // `staged` is not recorded again: the start recorded it after all of its
  // pushes, and the push queue is the device's, so a record now would also
  // follow later ops' pushes, behind flags that this invocation's watchdog
  // does not release.
  auto drained = [&](std::shared_ptr<Inv> inv, ffi::Error err) {
    *drain = inv;
    return ffi::Unexpected(PushFailDrained(backend, inv, device,
                                           std::move(err),
                                           /*restage=*/false));
  };
  auto found = UsableWindow<B>(a.window, device, who, kFaultDone);
  if (!found.has_value()) {
    // A poisoned window (its start's own copies may be what failed) or the
    // fault hook: the start's pushes, if it ran, are queued all the same.
    if (auto started = PushStates<B>::Get().TakeStarted(a.window, device)) {
      return drained(std::move(started), found.error());
    }
    return ffi::Unexpected(found.error());
  }
  std::shared_ptr<Window> win = *found;
  // Until the sum and the freed flags are enqueued, in epoch order.
  auto issue = IssueLock(*win, a.timeout_ms);
  auto inv = PushStates<B>::Get().TakeStarted(a.window, device);
  if (inv != nullptr) {
    if (ffi::Error err = CheckIssueLock(issue, *win, a.timeout_ms, who());
        err.failure()) {
      return drained(std::move(inv), std::move(err));
    }
  }
  if (inv == nullptr) {
    return ffi::Unexpected(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        who() + ": no ficco_push_start of this window ran before it on this"
        " device"));
  }
  auto in = ShapeOf(parts);
  if (!in.has_value()) return drained(inv, in.error());
  auto res = ShapeOf(out);
  if (!res.has_value()) return drained(inv, res.error());
  const int64_t rb = in->row_bytes, size = win->size, me = win->rank;
  const int64_t own_rows = a.num_chunks * a.chunk_rows;
  const int64_t elem = static_cast<int64_t>(ffi::ByteWidth(parts.element_type()));
  if (parts.element_type() != out.element_type() || res->row_bytes != rb ||
      res->rows != own_rows || a.chunk_rows < 1 || a.num_chunks < 1 ||
      a.own_row < 0 || a.own_row + own_rows > in->rows ||
      (size - 1) * own_rows * rb > a.half_bytes || elem == 0 ||
      rb % elem != 0) {
    return drained(inv, ffi::Error::InvalidArgument(
        who() + ": the result (" + std::to_string(res->rows) + " rows of " +
        std::to_string(res->row_bytes) + " bytes) must be rows [" +
        std::to_string(a.own_row) + ", +" + std::to_string(own_rows) +
        ") of the kernel's " + std::to_string(in->rows) + " rows of " +
        std::to_string(rb) + " bytes, of the same type, and " +
        std::to_string(size - 1) + " peers' pieces must fit a half of " +
        std::to_string(a.half_bytes) + " bytes"));
  }
  const uint32_t e = inv->epoch;
  const uint32_t ident = PushIdent(a);
  if constexpr (B::kHostOrdered) {
    // The peers' pushes of epoch e, whose ready flags the compute stream is
    // about to wait on, must be enqueued (usually long since: each rank
    // pushes right after its kernel launch, well before its finish).
    for (int64_t q = 0; q < size; ++q) {
      if (q == me) continue;
      ffi::Error err = HostWait(*win, q, kStagedEnqueued, e, a.timeout_ms,
                                inv->where);
      // Its pieces are about to be summed: they must be this op's.
      if (err.success()) err = CheckIdentOnHost(*inv, q, ident);
      if (err.failure()) {
        // It names the invocation: kept over PushFailDrained's message.
        inv->Fail(std::string(err.message()));
        return drained(inv, std::move(err));
      }
    }
  }
  const int64_t queue = B::kComputeQueue;
  auto run = [&]() -> ffi::Error {
    if constexpr (!B::kHostOrdered) {
      FICCO_RETURN_IF_FAILED(
          CheckIdentsInLane(backend, inv, device, queue, ident));
    }
    std::vector<FlagOp> ops;
    for (int64_t q = 0; q < size; ++q) {
      if (q == me) continue;
      ops.push_back({false, win->ReadyOf(win->base, q), e, WaitName<B>([&] {
                       return RankName(*win, q) + " to push epoch " +
                              std::to_string(e);
                     })});
    }
    FICCO_RETURN_IF_FAILED(backend.FlagOps(inv, device, queue, ops));
    // This rank's pushes read `parts`, which XLA may reuse after this call.
    FICCO_RETURN_IF_FAILED(backend.WaitEvent(inv, device, queue, inv->staged));
    FICCO_RETURN_IF_FAILED(backend.Sum(
        inv, device, queue, parts.element_type(),
        static_cast<char*>(out.untyped_data()),
        static_cast<const char*>(parts.untyped_data()) + a.own_row * rb,
        PushHalf(*win, win->base, e), a.num_chunks, size - 1,
        a.chunk_rows * rb / elem));
    return PushRelease(backend, inv, device, queue);
  };
  if (auto err = run(); err.failure()) return drained(inv, std::move(err));
  HostPublish(*win, kAllEnqueued, e);
  return inv;
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_PUSH_PROTOCOL_H_
