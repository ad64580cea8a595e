// The window transport's start (docs/windows.md), written once over the
// backend (backend.h); cpu_window.cc and cuda_window.cu define the
// backend's window queues, wait and done.
//
// start enqueues everything on queues of its own device. Where the backend
// orders flag waits on the host (kHostOrdered), the pulls wait for the
// peers' starts, so a per-device issuer thread enqueues them and XLA's
// thread goes on at once; wait and done first make sure they are enqueued.

#ifndef FICCO_XLA_FFI_WINDOW_PROTOCOL_H_
#define FICCO_XLA_FFI_WINDOW_PROTOCOL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "backend.h"
#include "dispatch_advice.h"
#include "epoch_runs.h"
#include "issuer.h"
#include "peer_copy_plan.h"
#include "peer_copy_protocol.h"  // ShapeOf
#include "window.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {


template <class B>
struct WindowInvocation {
  using Event = typename B::Event;
  std::shared_ptr<Window> win;
  Plan plan;
  uint32_t epoch = 0;
  // A writer of epoch e waits for its receiver's freed >= e - freed_lag:
  // kSlots here, the push protocol's two landing halves there.
  uint32_t freed_lag = kSlots;
  int64_t row_bytes = 0;
  std::vector<int64_t> source_offset;  // bytes into the slot
  Event* ready = nullptr;      // compute stream at start
  Event* staged = nullptr;     // sources copied into the slot
  Event* signalled = nullptr;  // every read from peers done and announced
  std::vector<Event*> arrival;  // per transfer
  std::vector<Event*> finals;   // per used pull queue
  // Landing flags (attrs.landed): int32[transfers] in an XLA buffer,
  // zeroed on the compute stream at start; transfer i's queue writes 1
  // after its copy. Null without them.
  uint32_t* landed = nullptr;
  std::string where;
  int64_t run_id = 0;  // the execution's (ffi::RunId)
  // Past it, an entry of this invocation that its wait or done never took
  // was left by an execution that XLA ended early (WindowIndex's sweep):
  // until then it may be another live execution's, whose wait is coming.
  Clock::time_point abandoned_after{};

  std::atomic<bool> failed_flag{false};
  // Whether the pulls and the announce are enqueued (kIssued) or failed
  // to be (kIssueFailed): off XLA's thread, wait and done must see them
  // enqueued before they wait for their events (`AwaitIssued`).
  std::atomic<int> issue_state{0};
  std::mutex mu;
  std::string failure;
  ffi::Error issue_error;  // under mu, once issue_state is kIssueFailed

  bool failed() const { return failed_flag.load(std::memory_order_acquire); }
  void Fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (failure.empty()) failure = why;
    }
    failed_flag.store(true, std::memory_order_release);
    win->Poison(why);
  }
  std::string Failure() {
    std::lock_guard<std::mutex> lock(mu);
    return failure;
  }
  std::vector<Event*> AllEvents() const {
    std::vector<Event*> all = arrival;
    all.insert(all.end(), finals.begin(), finals.end());
    for (Event* e : {ready, staged, signalled}) all.push_back(e);
    return all;
  }
  ~WindowInvocation() {
    for (Event* e : AllEvents()) {
      if (e != nullptr) B::ReleaseEvent(win->device, e);
    }
  }
};

inline constexpr int kIssued = 1, kIssueFailed = 2;
// How long past twice its timeout a start's entries wait for their wait
// and done before a later start drops them (abandoned_after).
inline constexpr int64_t kAbandonMarginMs = 5000;

// How wait and done find their invocation: by window family, device, the
// address of the landing buffer (wait) or of sources[0] (done), which stay
// live until that wait or done, and execution (run id), so that an entry
// an aborted execution left behind at a reused address never answers a
// later call, and two executions of one program in flight at once (two
// dispatching threads) each find their own.
template <class B>
class WindowIndex {
 public:
  using Inv = WindowInvocation<B>;
  static WindowIndex& Get() {
    static WindowIndex* index = new WindowIndex();
    return *index;
  }
  void Add(const std::shared_ptr<Inv>& inv, int32_t device,
           const std::vector<const void*>& landings, const void* source0) {
    std::lock_guard<std::mutex> lock(mu_);
    SweepLocked(*inv);
    const int64_t family = inv->win->family;
    for (size_t b = 0; b < landings.size(); ++b) {
      waits_[Key(family, device, landings[b], inv->epoch)] =
          Entry{inv, static_cast<int64_t>(b)};
    }
    dones_[Key(family, device, source0, inv->epoch)] = Entry{inv, -1};
  }
  std::pair<std::shared_ptr<Inv>, int64_t> TakeWait(int64_t family,
                                                    int32_t device,
                                                    const void* addr,
                                                    int64_t run_id) {
    return Take(waits_, family, device, addr, run_id);
  }
  std::shared_ptr<Inv> TakeDone(int64_t family, int32_t device,
                                const void* addr, int64_t run_id) {
    return Take(dones_, family, device, addr, run_id).first;
  }
  int64_t Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(waits_.size() + dones_.size());
  }
  // Takes the entries of every other invocation that `inv`'s execution
  // started on its device and fails them with `why`: XLA ends an execution
  // at its first failing handler, so no wait or done of theirs will come,
  // and their copies (into that execution's buffers) must stop and drain
  // before the error reaches XLA. Returns them, `inv` first.
  std::vector<std::shared_ptr<Inv>> FailRun(const std::shared_ptr<Inv>& inv,
                                            const std::string& why) {
    std::vector<std::shared_ptr<Inv>> run{inv};
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto* m : {&waits_, &dones_}) {
        for (auto it = m->begin(); it != m->end();) {
          const std::shared_ptr<Inv>& other = it->second.inv;
          if (other->run_id != inv->run_id ||
              other->win->device != inv->win->device) {
            ++it;
            continue;
          }
          if (std::find(run.begin(), run.end(), other) == run.end()) {
            run.push_back(other);
          }
          it = m->erase(it);
        }
      }
    }
    for (const auto& r : run) r->Fail(r == inv ? why : r->where + ": " + why);
    return run;
  }

  // The other invocations in flight on `inv`'s device, for a timeout's
  // message: "ficco window copy of 'op' (site 1, epoch 5) ...; ...", or "".
  std::string OthersInFlight(const Inv& inv) {
    std::lock_guard<std::mutex> lock(mu_);
    std::set<const Inv*> seen;
    std::string out;
    for (const Map* m : {&waits_, &dones_}) {
      for (const auto& [key, entry] : *m) {
        const Inv* other = entry.inv.get();
        if (other == &inv || other->win->device != inv.win->device ||
            !seen.insert(other).second) {
          continue;
        }
        out += (out.empty() ? "" : "; ") + other->where;
      }
    }
    return out;
  }

 private:
  // Drops what executions that XLA ended early left behind: they stop
  // before their later waits and dones run, so nothing would take those
  // entries. Only other executions' entries go, and only once past their
  // `abandoned_after`: before that, the execution may be in flight, from
  // another dispatching thread, and its wait or done must find its entry
  // (failed or not): one that found it gone could not drain its copies,
  // which XLA's freed buffers would then get.
  // Entries of `inv`'s own execution stay: one traced site can run twice
  // at once in one execution (docs/protocol.md, "Several runs of one
  // site"), and its buffers, live until its wait and done, key them apart.
  void SweepLocked(const Inv& inv) {
    const Clock::time_point now = Clock::now();
    for (auto* m : {&waits_, &dones_}) {
      for (auto it = m->begin(); it != m->end();) {
        const Inv& other = *it->second.inv;
        const bool gone =
            other.run_id != inv.run_id && now >= other.abandoned_after;
        it = gone ? m->erase(it) : std::next(it);
      }
    }
  }

  // The epoch last: two pending invocations of one execution can share
  // sources[0] (one buffer gathered twice, as a recomputation under
  // jax.checkpoint does), and a done takes the older of its execution's.
  // Which done ends which of them does not matter: every start has one
  // source (the lowering refuses more, peer_copy.py), so they stage the
  // same buffer, which outlives both dones, and each one's landing buffers
  // and flags are complete before the op's result, which its done gates,
  // is computed.
  using Key = std::tuple<int64_t, int32_t, const void*, uint32_t>;
  struct Entry {
    std::shared_ptr<Inv> inv;
    int64_t landing = -1;
  };
  using Map = std::map<Key, Entry>;
  std::pair<std::shared_ptr<Inv>, int64_t> Take(Map& m, int64_t family,
                                                int32_t device,
                                                const void* addr,
                                                int64_t run_id) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = m.lower_bound(Key(family, device, addr, 0));
         it != m.end() && std::get<0>(it->first) == family &&
         std::get<1>(it->first) == device && std::get<2>(it->first) == addr;
         ++it) {
      if (it->second.inv->run_id != run_id) continue;
      Entry e = std::move(it->second);
      m.erase(it);
      return {std::move(e.inv), e.landing};
    }
    return {nullptr, -1};
  }
  std::mutex mu_;
  Map waits_, dones_;
};

// "rank 2 (device 6)": a rank of the window's group, for messages.
inline std::string RankName(const Window& w, int64_t q) {
  return "rank " + std::to_string(q) + " (device " +
         std::to_string(w.group_ids[q]) + ")";
}

// The ranks that have not signalled epoch `e` yet, given this rank's
// header words (ready[q], freed[q]) and how far behind a freed flag may be
// (`lag`, WindowInvocation::freed_lag): "rank 2 (device 2), ...", or "".
inline std::string Unsignalled(const Window& w, const uint32_t* header,
                               uint32_t e, uint32_t lag) {
  std::string out;
  for (int64_t q = 0; q < w.size; ++q) {
    if (q == w.rank) continue;
    const bool staged = static_cast<int32_t>(header[q] - e) >= 0;
    const bool freed =
        e <= lag || static_cast<int32_t>(header[kMaxRanks + q] - (e - lag)) >= 0;
    if (!staged || !freed) {
      out += (out.empty() ? "" : ", ") + RankName(w, q);
    }
  }
  return out;
}

// "ficco window wait of 'op' on device 2", for errors.
inline std::string WindowWho(std::string_view phase, std::string_view op,
                             int32_t device) {
  return "ficco window " + std::string(phase) + " of '" + std::string(op) +
         "' on device " + std::to_string(device);
}

// After IssueLock, whether this call may go on: not if another thread's
// handler held the window for over `timeout_ms` (the peers take an epoch
// this rank will not, so the window is poisoned), nor if the window was
// poisoned while this one waited (UsableWindow's check came before); so
// this call takes no epoch then.
inline ffi::Error CheckIssueLock(const std::unique_lock<std::timed_mutex>& lock,
                                 const Window& w, int64_t timeout_ms,
                                 const std::string& who) {
  // The "held" fault hook stands for a holder that never lets go.
  const bool hook = Faults(w.device, kFaultHeld);
  if (!lock.owns_lock() || hook) {
    const std::string why =
        who + ": another host thread's call held this window on this device"
        " for over " + std::to_string(timeout_ms) + " ms" +
        (hook ? " (the fault test hook, held)" : "") + "; " +
        kIfSeveralDispatchers + kAfterWindowTimeout;
    Windows::Get().PoisonFamily(w.platform, w.family, why);
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, why);
  }
  if (!w.Poisoned()) return ffi::Error::Success();
  return ffi::Error(
      ffi::ErrorCode::kFailedPrecondition,
      who + ": an earlier invocation on this window failed, so its ranks"
      " no longer agree on epochs; call jax.clear_caches() to lower onto"
      " fresh windows (" FICCO_AOT_ADVICE "). The failure: " + w.Sticky());
}

// A wait or done that found no entry: the failure of its window, if an
// earlier invocation poisoned it, else a misuse.
template <class B>
ffi::Error WindowMissError(int64_t family, std::string_view phase,
                           std::string_view op, int32_t device);

inline std::string WindowMiss(std::string_view phase, std::string_view op,
                              int32_t device) {
  return "ficco window " + std::string(phase) + " of '" + std::string(op) +
         "' on device " + std::to_string(device) +
         ": no pending start matches this buffer; pass each start output,"
         " unchanged, to exactly one wait, and sources[0] to done, and"
         " order the done after its start by data (it must read a buffer"
         " computed from that start's outputs: XLA orders custom calls by"
         " data alone)";
}

#define FICCO_RETURN_IF_FAILED(expr)                          \
  do {                                                        \
    if (::xla::ffi::Error _e = (expr); _e.failure()) return _e; \
  } while (0)

// Polls `reached` until it holds (true) or `timeout_ms` passes (false):
// yields for 300 us, then naps, since what it waits for is another host
// thread, usually microseconds away.
template <class Pred>
bool SpinThenNap(Pred reached, int64_t timeout_ms) {
  if (reached()) return true;
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(timeout_ms);
  const auto spin_until = start + std::chrono::microseconds(300);
  while (!reached()) {
    const auto now = Clock::now();
    if (now >= deadline) return false;
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  return true;
}

// Bounded host wait until rank q's host word `which` reaches epoch e
// (cyclic comparison).
inline ffi::Error HostWait(const Window& w, int64_t q, int64_t which,
                           uint32_t e, int64_t timeout_ms,
                           const std::string& where) {
  const uint32_t* word = w.peer_host[q] + which;
  if (SpinThenNap(
          [&] {
            return static_cast<int32_t>(
                       __atomic_load_n(word, __ATOMIC_ACQUIRE) - e) >= 0;
          },
          timeout_ms)) {
    return ffi::Error::Success();
  }
  const std::string rank = RankName(w, q);
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                    where + ": waited more than " +
                        std::to_string(timeout_ms) + " ms for " + rank +
                        " to issue epoch " + std::to_string(e) + "; " +
                        NeverSignalled(rank));
}

inline void HostPublish(const Window& w, int64_t which, uint32_t e) {
  __atomic_store_n(w.host + which, e, __ATOMIC_RELEASE);
}

// Takes the events of `inv`, records `ready` on the compute stream and
// enqueues the stage; `WindowPull` enqueues the rest.
template <class B>
ffi::Error WindowStage(B& backend, int32_t device,
                       const std::shared_ptr<WindowInvocation<B>>& inv,
                       const std::vector<const char*>& source_ptrs,
                       const std::vector<BufferShape>& sources) {
  const Plan& p = inv->plan;
  Window* win = inv->win.get();
  const uint32_t e = inv->epoch;

  auto take = [&](typename B::Event** slot) -> ffi::Error {
    auto ev = B::AcquireEvent(device);
    if (!ev.has_value()) return ev.error();
    *slot = *ev;
    return ffi::Error::Success();
  };
  FICCO_RETURN_IF_FAILED(take(&inv->ready));
  FICCO_RETURN_IF_FAILED(take(&inv->staged));
  FICCO_RETURN_IF_FAILED(take(&inv->signalled));
  inv->arrival.assign(p.transfers.size(), nullptr);
  for (auto& ev : inv->arrival) FICCO_RETURN_IF_FAILED(take(&ev));
  inv->finals.assign(p.streams_used.size(), nullptr);
  for (auto& ev : inv->finals) FICCO_RETURN_IF_FAILED(take(&ev));

  const int64_t me = win->rank, size = win->size;
  if (inv->landed != nullptr) {
    // Before `ready`, which every pull queue waits for: no flag write of
    // this invocation can land before the zeros.
    FICCO_RETURN_IF_FAILED(backend.ZeroOnCompute(
        inv->landed, p.transfers.size() * sizeof(uint32_t)));
  }
  // The sources are complete and the landing buffers free on the compute
  // stream now.
  FICCO_RETURN_IF_FAILED(backend.RecordOnCompute(device, inv->ready));

  const int64_t timeout_ms = p.timeout_ms;
  if constexpr (B::kHostOrdered) {
    // Enqueue a flag wait only after its writer has enqueued the write
    // (docs/windows.md, "Why the host orders the waits"): the freed writes
    // of epoch e - 1 ...
    for (int64_t q = 0; e > 1 && q < size; ++q) {
      if (q == me) continue;
      FICCO_RETURN_IF_FAILED(
          HostWait(*win, q, kAllEnqueued, e - 1, timeout_ms, inv->where));
    }
  }
  // Stage: copy the sources into the slot once every peer has finished
  // reading epoch e - kSlots from it, then tell every peer they are there.
  FICCO_RETURN_IF_FAILED(backend.WaitEvent(inv, device, kStageQueue, inv->ready));
  if (e > kSlots) {
    for (int64_t q = 0; q < size; ++q) {
      if (q == me) continue;
      FICCO_RETURN_IF_FAILED(backend.WaitFlag(
          inv, device, kStageQueue, win->FreedOf(win->base, q), e - kSlots,
          RankName(*win, q) + " to finish reading epoch " +
              std::to_string(e - kSlots)));
    }
  }
  char* slot = win->Slot(win->base, e);
  for (size_t s = 0; s < sources.size(); ++s) {
    FICCO_RETURN_IF_FAILED(backend.Copy(
        inv, device, kStageQueue, slot + inv->source_offset[s], source_ptrs[s],
        static_cast<size_t>(sources[s].rows * sources[s].row_bytes)));
  }
  FICCO_RETURN_IF_FAILED(backend.Record(inv, device, kStageQueue, inv->staged));
  if constexpr (B::kStageBeforeCompute) {
    // The stage is on every peer's critical path (their pulls wait for it),
    // and a device-local copy crawls beside a kernel that fills the GPU
    // (5x slower under the all-gather's own matmul on H200): let it run
    // alone first; it takes microseconds on an idle GPU.
    FICCO_RETURN_IF_FAILED(backend.WaitOnCompute(device, inv->staged));
  }
  for (int64_t q = 0; q < size; ++q) {
    if (q == me) continue;
    FICCO_RETURN_IF_FAILED(backend.WriteFlag(inv, device, kStageQueue,
                                             win->ReadyOf(win->peers[q], me), e));
  }

  HostPublish(*win, kStagedEnqueued, e);
  return ffi::Error::Success();
}

// The rest of an invocation after `WindowStage`: each pull queue waits for
// its owners' ready flags and copies, then the signal queue announces that
// this rank is done reading epoch e.
template <class B>
ffi::Error WindowPull(B& backend, int32_t device,
                      const std::shared_ptr<WindowInvocation<B>>& inv,
                      const std::vector<char*>& landing_ptrs) {
  const Plan& p = inv->plan;
  Window* win = inv->win.get();
  const uint32_t e = inv->epoch;
  const int64_t me = win->rank, size = win->size;
  if constexpr (B::kHostOrdered) {
    // ... and the ready writes of epoch e.
    for (int64_t q = 0; q < size; ++q) {
      if (q == me) continue;
      FICCO_RETURN_IF_FAILED(
          HostWait(*win, q, kStagedEnqueued, e, p.timeout_ms, inv->where));
    }
  }
  // A wait or done that failed meanwhile drains only the copies enqueued
  // before it (cuda_window.cu, FailDrained): enqueue none after.
  if (inv->failed()) {
    return ffi::Error(ffi::ErrorCode::kAborted,
                      inv->where + ": failed before its copies were enqueued");
  }

  // Pull: each queue waits for its owners' flags, then copies in plan order.
  const int64_t rb = inv->row_bytes;
  for (size_t j = 0; j < p.streams_used.size(); ++j) {
    const int64_t k = p.streams_used[j];
    FICCO_RETURN_IF_FAILED(backend.WaitEvent(inv, device, k, inv->ready));
    std::vector<bool> waited(size, false);
    for (size_t i = 0; i < p.transfers.size(); ++i) {
      const Transfer& t = p.transfers[i];
      if (t.stream != k) continue;
      const int64_t owner = (me + t.src_offset) % size;
      if (!waited[owner]) {
        waited[owner] = true;
        FICCO_RETURN_IF_FAILED(backend.WaitFlag(
            inv, device, k, win->ReadyOf(win->base, owner), e,
            RankName(*win, owner) + " to stage epoch " +
                std::to_string(e)));
      }
      const char* src = win->Slot(win->peers[owner], e) +
                        inv->source_offset[t.src] + t.src_row * rb;
      FICCO_RETURN_IF_FAILED(backend.Copy(inv, device, k,
                                          landing_ptrs[t.dst] + t.dst_row * rb,
                                          src, static_cast<size_t>(t.rows * rb)));
      if (inv->landed != nullptr) {
        // After the copy on its queue: the write's default flags fence it.
        FICCO_RETURN_IF_FAILED(
            backend.WriteFlag(inv, device, k, inv->landed + i, 1));
      }
      // After the flag write too: a failed run's drain waits for the
      // arrivals, so no write of it lands in memory XLA has reused.
      FICCO_RETURN_IF_FAILED(backend.Record(inv, device, k, inv->arrival[i]));
    }
    FICCO_RETURN_IF_FAILED(backend.Record(inv, device, k, inv->finals[j]));
  }

  // Announce: once every pull has finished, every peer may reuse its slot.
  for (auto* final_event : inv->finals) {
    FICCO_RETURN_IF_FAILED(
        backend.WaitEvent(inv, device, kSignalQueue, final_event));
  }
  for (int64_t q = 0; q < size; ++q) {
    if (q == me) continue;
    FICCO_RETURN_IF_FAILED(backend.WriteFlag(inv, device, kSignalQueue,
                                             win->FreedOf(win->peers[q], me), e));
  }
  FICCO_RETURN_IF_FAILED(
      backend.Record(inv, device, kSignalQueue, inv->signalled));
  HostPublish(*win, kAllEnqueued, e);
  return ffi::Error::Success();
}

// A consumer kernel may wait on the device for a failed invocation's
// landing flags, and no pull of it will set them now: set them all (the
// pieces are garbage; the op's wait or done, or the next call on the
// window, reports the failure), on the signal queue, which holds nothing of
// this invocation (its work is enqueued after every pull's) and waits for
// `ready` (the flags' zeros) first; then record `signalled` there, which a
// failed run's drain waits for, so no write lands in memory XLA has reused.
// The CPU twin writes no flag of a failed invocation: its consumer waits
// for the arrival events instead.
template <class B>
void ReleaseLanded(B& backend, int32_t device,
                   const std::shared_ptr<WindowInvocation<B>>& inv) {
  if (inv->landed == nullptr || inv->ready == nullptr) return;
  if (backend.WaitEvent(inv, device, kSignalQueue, inv->ready).failure()) {
    return;
  }
  for (size_t i = 0; i < inv->plan.transfers.size(); ++i) {
    (void)backend.WriteFlag(inv, device, kSignalQueue, inv->landed + i, 1);
  }
  if (inv->signalled != nullptr) {
    (void)backend.Record(inv, device, kSignalQueue, inv->signalled);
  }
}

// The window of `family` on `device`, if a call may use it: made, not
// poisoned, not refused by the fault test hook at `step` (kFaultStart, ...).
// `who` names the call in errors ("ficco window start of 'op' on device
// 2"), built only then.
template <class B, class Who>
ffi::ErrorOr<std::shared_ptr<Window>> UsableWindow(int64_t family,
                                                   int32_t device, Who who,
                                                   int step = kFaultStart) {
  std::shared_ptr<Window> win = Windows::Get().Find(B::kPlatform, family, device);
  std::string sticky = Windows::Get().Failure(B::kPlatform, family, win.get());
  if (win == nullptr && sticky.empty()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        who() + ": no window of family " + std::to_string(family) +
        " (windows are made when the op is lowered, in this process)"));
  }
  // A retired family (lowering replaced it) has no windows left here. A
  // call's first step also takes a peer's failure for its own.
  if (sticky.empty() && step == kFaultStart && win->PeerPoisoned()) {
    sticky = win->Sticky();
  }
  if (!sticky.empty()) {
    return ffi::Unexpected(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        who() + ": an earlier invocation on this window failed, so its ranks"
        " no longer agree on epochs; call jax.clear_caches() to lower onto"
        " fresh windows (" FICCO_AOT_ADVICE "). The failure: " + sticky));
  }
  if (Faults(device, step)) {
    return ffi::Unexpected(ffi::Error(
        ffi::ErrorCode::kUnavailable,
        who() + ": refused by the " +
            (step == kFaultStart ? "never-arrive" : "fault") + " test hook"));
  }
  return win;
}

template <class B>
ffi::Error WindowMissError(int64_t family, std::string_view phase,
                           std::string_view op, int32_t device) {
  std::shared_ptr<Window> win = Windows::Get().Find(B::kPlatform, family, device);
  const std::string sticky =
      Windows::Get().Failure(B::kPlatform, family, win.get());
  if (!sticky.empty()) {
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        WindowWho(phase, op, device) + ": an earlier invocation on this"
        " window failed; call jax.clear_caches() to lower onto fresh"
        " windows (" FICCO_AOT_ADVICE "). The failure: " + sticky);
  }
  return ffi::Error::InvalidArgument(WindowMiss(phase, op, device));
}

// start on `device`: see docs/windows.md, "start, wait and done".
template <class B>
ffi::Error WindowStart(B& backend, int64_t run_id, int64_t instance,
                       int32_t device,
                       ffi::RemainingArgs args, ffi::RemainingRets rets,
                       const Attrs& attrs) {
  using Inv = WindowInvocation<B>;
  const std::string op(attrs.op_name);
  auto found = UsableWindow<B>(attrs.window, device, [&] {
    return "ficco window start of '" + op + "' on device " +
           std::to_string(device);
  });
  if (!found.has_value()) return found.error();
  std::shared_ptr<Window> win = *found;
  std::vector<BufferShape> sources, landings;
  std::vector<const char*> source_ptrs;
  std::vector<char*> landing_ptrs;
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    auto s = ShapeOf(*b);
    if (!s.has_value()) return s.error();
    sources.push_back(*s);
    source_ptrs.push_back(static_cast<const char*>(b->untyped_data()));
  }
  // With landing flags, the last result is the flags.
  const size_t num_landings = rets.size() - (attrs.landed ? 1 : 0);
  for (size_t i = 0; i < num_landings; ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    auto s = ShapeOf(**b);
    if (!s.has_value()) return s.error();
    landings.push_back(*s);
    landing_ptrs.push_back(static_cast<char*>((*b)->untyped_data()));
  }
  auto plan = MakePlan(attrs, sources, landings);
  if (!plan.has_value()) return plan.error();
  uint32_t* landed = nullptr;
  if (attrs.landed) {
    auto b = rets.get<ffi::AnyBuffer>(num_landings);
    if (!b.has_value()) return b.error();
    if ((*b)->element_type() != ffi::DataType::S32 ||
        (*b)->element_count() != plan->transfers.size()) {
      return ffi::Error::InvalidArgument(
          "ficco window start of '" + op + "': its landing flags must be" +
          " int32[" + std::to_string(plan->transfers.size()) +
          "] (one per transfer)");
    }
    landed = static_cast<uint32_t*>((*b)->untyped_data());
  }
  if (plan->axis_size != win->size) {
    return ffi::Error::InvalidArgument(
        "ficco window start of '" + op + "': axis_size " +
        std::to_string(plan->axis_size) + " but the window's group has " +
        std::to_string(win->size) + " ranks");
  }
  auto inv = std::make_shared<Inv>();
  inv->win = win;
  inv->plan = std::move(*plan);
  inv->landed = landed;
  const Plan& p = inv->plan;
  inv->row_bytes = sources[0].row_bytes;
  int64_t offset = 0;
  for (const BufferShape& s : sources) {
    inv->source_offset.push_back(offset);
    offset += (s.rows * s.row_bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
  }
  if (offset > win->slot_bytes) {
    return ffi::Error::InvalidArgument(
        "ficco window start of '" + op + "': the sources need " +
        std::to_string(offset) + " bytes but the window's slots hold " +
        std::to_string(win->slot_bytes));
  }
  for (const Transfer& t : p.transfers) {
    if (t.src < 0) {
      return ffi::Error::InvalidArgument(
          "ficco window start of '" + op +
          "': a transfer forwards a landing buffer; the window transport"
          " pulls every piece from its owner (plan.owner_pulls())");
    }
  }
  // Until the stage and the pulls are enqueued (or handed to the issuer),
  // in epoch order.
  auto issue = IssueLock(*win, p.timeout_ms);
  FICCO_RETURN_IF_FAILED(CheckIssueLock(
      issue, *win, p.timeout_ms,
      "ficco window start of '" + op + "' on device " +
          std::to_string(device)));
  const uint32_t e = win->epoch.fetch_add(1) + 1;
  inv->epoch = e;
  inv->run_id = run_id;
  // A live execution reaches this start's wait and done within its host
  // work, each host wait of which ends by its op's timeout; twice that and
  // a margin, and it has been ended.
  inv->abandoned_after = DeadlineAfter(2 * p.timeout_ms + kAbandonMarginMs);
  inv->where = WindowWhere(p, *win, e);
  // From here on this rank has taken epoch e: any failure must poison the
  // window, or its ranks would pair different invocations from now on.
  FICCO_RETURN_IF_FAILED(
      CheckEpochRun(B::kPlatform, *win, e, run_id, inv->where, instance));
  if (ffi::Error staged = WindowStage(backend, device, inv, source_ptrs,
                                      sources);
      staged.failure()) {
    inv->Fail(inv->where + ": " + std::string(staged.message()));
    return staged;
  }
  std::vector<const void*> addrs(landing_ptrs.begin(), landing_ptrs.end());
  auto pull = [backend, device, inv, landing_ptrs]() mutable {
    ffi::Error pulled = WindowPull(backend, device, inv, landing_ptrs);
    if (pulled.failure()) {
      inv->Fail(inv->where + ": " + std::string(pulled.message()));
      ReleaseLanded(backend, device, inv);
      std::lock_guard<std::mutex> lock(inv->mu);
      inv->issue_error = pulled;
    }
    inv->issue_state.store(pulled.failure() ? kIssueFailed : kIssued,
                           std::memory_order_release);
    return pulled;
  };
  if constexpr (B::kHostOrdered) {
    // The pulls' waits are enqueued only once every peer has enqueued its
    // stage, which takes a host wait for the peers' starts. On XLA's thread
    // that wait would hold back the kernels after this start (the own
    // piece's) until the slowest peer arrives; the device's issuer thread
    // waits instead, and wait and done hold XLA's thread only when they
    // come before the pulls are enqueued (`AwaitIssued`).
    WindowIndex<B>::Get().Add(inv, device, addrs, source_ptrs[0]);
    IssuerOf<B>(device).Push(std::move(pull));
    return ffi::Error::Success();
  }
  FICCO_RETURN_IF_FAILED(pull());
  WindowIndex<B>::Get().Add(inv, device, addrs, source_ptrs[0]);
  return ffi::Error::Success();
}

// The tail of a window timeout on this device when every peer signalled:
// its copies queued behind other work here, which happens when programs
// dispatched from several threads run in different orders on different
// devices; names the invocations still in flight on this device.
template <class B>
std::string QueuedBehind(const WindowInvocation<B>& inv) {
  const std::string others = WindowIndex<B>::Get().OthersInFlight(inv);
  return std::string("every peer signalled, but this device's copies did not"
                     " finish") +
         (others.empty() ? "" : " (also in flight on this device: " + others +
                                    ")") +
         "; " + kIfSeveralDispatchers + kAfterWindowTimeout;
}

// Blocks until `inv`'s pulls are enqueued (`WindowPull`, maybe on the
// issuer thread); their failure, if they could not be. `who` names the
// caller ("ficco window wait of 'op' on device 2").
template <class B>
ffi::Error AwaitIssued(WindowInvocation<B>& inv, const std::string& who) {
  auto state = [&] { return inv.issue_state.load(std::memory_order_acquire); };
  // The issuer's own host waits are bounded by timeout_ms; this bound only
  // guards against an issuer stuck behind an earlier invocation's.
  const int64_t bound_ms = 2 * inv.plan.timeout_ms;
  if (!SpinThenNap([&] { return state() != 0; }, bound_ms)) {
    const std::string why = who + ": the copies of " + inv.where +
                            " were not enqueued within " +
                            std::to_string(bound_ms) + " ms";
    inv.Fail(why);
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, why);
  }
  if (state() == kIssueFailed) {
    std::lock_guard<std::mutex> lock(inv.mu);
    return inv.issue_error;
  }
  return ffi::Error::Success();
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_WINDOW_PROTOCOL_H_
