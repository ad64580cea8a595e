// Host-side state of the peer-copy protocol, shared by the CPU twin and the
// CUDA handlers: invocations, the rendezvous that matches the P starts of one
// invocation, and the indexes through which wait and done find it again.
//
// Templated over a Backend that supplies the "event" (a CUDA event, or a flag
// with a condition variable on CPU) and per-device event pools:
//   using Event = ...;
//   static ffi::ErrorOr<Event*> AcquireEvent(int32_t device);
//   static void ReleaseEvent(int32_t device, Event* event);

#ifndef FICCO_XLA_FFI_PEER_COPY_REGISTRY_H_
#define FICCO_XLA_FFI_PEER_COPY_REGISTRY_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "peer_copy_plan.h"
#include "spin_mutex.h"
#include "stall_breaker.h"

namespace ficco {

using Clock = std::chrono::steady_clock;

// How long SpinThenWait spins before it sleeps: long enough to cover a
// peer's usual lag within one op, short enough that an absent peer costs
// only a brief burst of CPU.
inline constexpr std::chrono::microseconds kWaitSpin{300};

// Waits until `pred` holds, spinning (with yields) for a short while before
// sleeping on `cv`; returns with `lock` held, whether it was held on entry or
// not. The CUDA handlers hand off to each other several times per op
// (rendezvous, ring forwarding, issue complete); a sleeping thread takes
// tens of microseconds to wake, which would make sub-millisecond ops
// host-bound. The spin is bounded, so an absent peer still costs no more
// than a short burst of CPU before the thread sleeps until the deadline.
//
// The spin reads `pred` WITHOUT the lock, so `pred` may read only atomics
// (Invocation's `arrived`, `issued`, `recorded`, `failed()`): up to eight
// threads spin on one invocation at a time (four issuers in its rendezvous,
// four syncs awaiting its issue); if each took the mutex on every turn, the
// starts that publish under it and the issuers that mark it issued would
// queue behind them, parking in futex waits of tens of microseconds.
// Writers still update those fields under the mutex, so the sleeping phase
// (which re-checks `pred` under it) cannot miss a wake-up.
template <class Pred>
bool SpinThenWait(std::unique_lock<std::mutex>& lock,
                  std::condition_variable& cv, Clock::time_point deadline,
                  Pred pred) {
  if (lock.owns_lock()) lock.unlock();
  const auto spin_until = Clock::now() + kWaitSpin;
  while (!pred()) {
    if (Clock::now() >= spin_until) {
      lock.lock();
      return cv.wait_until(lock, deadline, pred);
    }
    std::this_thread::yield();
  }
  lock.lock();
  return true;
}

inline Clock::time_point DeadlineAfter(int64_t ms) {
  return Clock::now() + std::chrono::milliseconds(ms);
}

// Test hooks (diagnostics.cc), so that failure paths can be exercised: a
// protocol step of one device fails at once. The steps, per transport:
//   kFaultStart: rendezvous start, window start, push arm, push all-gather;
//   kFaultWait:  rendezvous sync that waits for landing buffers, window
//                wait, push start, push all-gather after its pushes are
//                queued;
//   kFaultDone:  rendezvous sync that ends invocations, window done, push
//                finish;
//   kFaultHeld:  every handler that takes a window's issue lock (window
//                start, push start, finish and all-gather) finds it held by
//                another thread for longer than the op's timeout.
// The rendezvous transport's waits and dones are one handler, sync, which
// may do both in one call: it fails under either hook then. A refused sync
// fails before it takes any of its parts, so every registration of its
// execution on that device is left to the failure path, as after an error
// anywhere else in the program.
inline constexpr int kFaultStart = 1, kFaultWait = 2, kFaultDone = 3,
                     kFaultHeld = 4;
bool Faults(int32_t device, int step);
// A rank that never arrives: its first step fails.
inline bool NeverArrives(int32_t device) { return Faults(device, kFaultStart); }

// The rendezvous sync's hook on `device` for a call that waits for landing
// buffers (`waits`) and/or ends invocations (`ends`): the error message, or
// "" if the hook lets it run.
inline std::string SyncFault(int32_t device, bool waits, bool ends,
                             std::string_view op_name) {
  const char* step = waits && Faults(device, kFaultWait)  ? "wait"
                     : ends && Faults(device, kFaultDone) ? "done"
                                                          : nullptr;
  if (step == nullptr) return "";
  return "ficco peer copy sync of '" + std::string(op_name) + "' on device " +
         std::to_string(device) + ": refused by the fault test hook (" +
         step + ")";
}

// Order of enqueues on the side queues, process-wide: a queue's enqueues
// come from one thread at a time (its device's thread, or the last arriver
// under the issue lock), so stamps taken right after each record follow
// every queue's order.
inline uint64_t IssueStamp() {
  static std::atomic<uint64_t> next{0};
  return next.fetch_add(1, std::memory_order_relaxed) + 1;
}

// Host time of the handlers, per backend (FiccoHostStats in ficco_ffi.h):
// what a host-bound op spends where, without a profiler (which inflates
// every CUDA call). Always on: two clock reads per measured section.
enum HostStat {
  kStartTotal = 0,     // whole start handler
  kStartRendezvous,    // of which: waiting for the peers to publish
  kStartIssue,         // of which: enqueueing this rank's copies
  kSyncTotal,          // whole sync handler
  kSyncWaits,          // compute-stream waits sync enqueued
  kNumHostStats,
};

struct HostStats {
  std::atomic<int64_t> calls[kNumHostStats] = {};
  std::atomic<int64_t> ns[kNumHostStats] = {};

  void Add(HostStat s, Clock::time_point since, int64_t count = 1) {
    calls[s].fetch_add(count, std::memory_order_relaxed);
    ns[s].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        Clock::now() - since).count(),
                    std::memory_order_relaxed);
  }
  void Reset() {
    for (int i = 0; i < kNumHostStats; ++i) {
      calls[i].store(0);
      ns[i].store(0);
    }
  }
  // The C API's half (FiccoHostStats): false if `stat` is out of range.
  bool Read(int stat, int64_t* n, int64_t* total_ns) const {
    if (stat < 0 || stat >= kNumHostStats) return false;
    *n = calls[stat].load();
    *total_ns = ns[stat].load();
    return true;
  }
};

// Identifies one invocation: the same on the P devices of a group. The
// instance is the start instruction on XLA:CPU (start_instance.h), 0 on
// CUDA, whose devices run a site's instructions in one order.
struct Key {
  int64_t run_id, site, instance, group, seq;
  bool operator<(const Key& o) const {
    return std::tie(run_id, site, instance, group, seq) <
           std::tie(o.run_id, o.site, o.instance, o.group, o.seq);
  }
};

template <class Backend>
struct Invocation {
  using Event = typename Backend::Event;

  // What one rank publishes at start; read-only once it counts as arrived
  // (`left` is guarded by the invocation's mutex).
  struct Rank {
    bool arrived = false;
    int32_t device = -1;
    std::vector<const char*> sources;
    std::vector<char*> landings;
    Event* ready = nullptr;         // sources complete on the compute stream
                                    // (flagged: landings free, flags zeroed)
    std::vector<Event*> piece_ready;  // flagged: per flag, its rows complete
    std::vector<Event*> arrival;    // per transfer: its copy has landed
    // Per transfer: IssueStamp() when its arrival was recorded. A queue runs
    // in issue order, so of several events on one queue the newest implies
    // the others (sync waits for that one only).
    std::vector<uint64_t> stamps;
    bool left = false;              // passed done or gave up
  };

  Invocation(Key key, std::shared_ptr<const Plan> plan, int64_t row_bytes)
      : key(key), plan(std::move(plan)), row_bytes(row_bytes),
        ranks(this->plan->axis_size),
        recorded(new std::atomic<int64_t>[this->plan->axis_size]),
        joined(new std::atomic<bool>[this->plan->axis_size]) {
    for (int64_t r = 0; r < this->plan->axis_size; ++r) {
      recorded[r].store(0);
      joined[r].store(false);
    }
    live.fetch_add(1);
  }
  ~Invocation() {
    // Every rank passed its sync (which waited for the copies reading its
    // buffers) or the invocation failed; a queued record of a recycled
    // event is harmless (see ReleaseEvent), so they can be recycled.
    for (Rank& r : ranks) ReleaseEvents(r);
    live.fetch_sub(1);
  }
  Invocation(const Invocation&) = delete;
  Invocation& operator=(const Invocation&) = delete;

  static void ReleaseEvents(Rank& r) {
    if (r.device < 0) return;
    if (r.ready) Backend::ReleaseEvent(r.device, r.ready);
    for (Event* e : r.arrival) if (e) Backend::ReleaseEvent(r.device, e);
    for (Event* e : r.piece_ready) if (e) Backend::ReleaseEvent(r.device, e);
    r.ready = nullptr;
    r.arrival.clear();
    r.piece_ready.clear();
  }

  // Records the first failure and wakes every host wait on this invocation,
  // so peers fail fast instead of running into their own timeouts.
  void Fail(const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(mu);
      FailLocked(message);
    }
    cv.notify_all();
  }
  // Fail's state change, for callers that hold `mu` (and notify `cv` after).
  void FailLocked(const std::string& message) {
    if (failure.empty()) {
      failure = message;
      failed_at = Clock::now();
    }
    has_failed.store(true);
  }
  bool failed() const { return has_failed.load(); }

  const Key key;
  const std::shared_ptr<const Plan> plan;
  const int64_t row_bytes;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Rank> ranks;
  // `arrived`, `issued` and `recorded` are written under `mu` (for `cv`) and
  // are atomic so that SpinThenWait may poll them without it.
  std::atomic<int64_t> arrived{0};
  int64_t left = 0;
  // Every rank's copies and events are issued (by the last rank to arrive,
  // or, with parallel or async issue (issuer.h), by each rank for the copies
  // it receives; `issued` is then set by the last rank to finish).
  std::atomic<bool> issued{false};
  // Parallel and async issue only: per rank, how many of its transfers have
  // their arrival events recorded (ring forwarding waits on these), and how
  // many ranks have issued everything.
  std::unique_ptr<std::atomic<int64_t>[]> recorded;
  // Per rank: it joined (Registry::Join); read without `mu` under the
  // registry's lock, to tell where a device that stalls a peer waits.
  std::unique_ptr<std::atomic<bool>[]> joined;
  int64_t issued_ranks = 0;
  // Run once issued, or once a rank gave up (CPU waits that block no
  // thread; they check failed()).
  std::vector<std::function<void()>> on_issued;
  // Set when a rank gave up waiting for its peers: a late arriver must fail
  // at once instead of waiting for ranks that are gone.
  bool abandoned = false;
  std::string failure;
  Clock::time_point failed_at;
  std::atomic<bool> has_failed{false};

  static inline std::atomic<int64_t> live{0};
};

template <class Backend>
class Registry {
 public:
  using Inv = Invocation<Backend>;

  // Leaked on purpose: copy-queue threads may still touch invocations while
  // the interpreter exits, after static destructors would have run.
  static Registry& Get() {
    static Registry* registry = new Registry();
    return *registry;
  }

  HostStats& stats() { return stats_; }

  // What ficco_flags_arm hands to the start of its site (flagged plans):
  // the event that marks the flags zeroed and the landing buffers free, and
  // the addresses the start must find again (a copy XLA inserted between
  // them would break both promises).
  struct Armed {
    typename Backend::Event* ready = nullptr;
    const char* flags = nullptr;
    std::vector<char*> landings;
  };
  // First in first out per (device, run id, site): a scan arms and starts
  // one site many times under one run id, always in that order.
  void PushArmed(int32_t device, int64_t run_id, int64_t site, Armed a) {
    {
      std::lock_guard<SpinMutex> lock(mu_);
      // No start of a failed execution takes it (NoteFailure).
      if (!RunFailedLocked(device, run_id)) {
        armed_[{device, run_id, site}].push_back(std::move(a));
        return;
      }
    }
    Backend::ReleaseEvent(device, a.ready);
  }
  bool PopArmed(int32_t device, int64_t run_id, int64_t site, Armed* out) {
    std::lock_guard<SpinMutex> lock(mu_);
    auto it = armed_.find({device, run_id, site});
    if (it == armed_.end()) return false;
    *out = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) armed_.erase(it);
    return true;
  }

  // Who issues copies (issuer.h, IssueMode); set through the C API between
  // ops, never while one is in flight.
  std::atomic<int>& mode() { return mode_; }

  // seq of a start: how many starts of `site` by start instruction
  // `instance` this device ran before in this execution. A scan runs one
  // instruction many times under one run id.
  int64_t NextSeq(int32_t device, int64_t run_id, int64_t site,
                  int64_t instance) {
    std::lock_guard<SpinMutex> lock(mu_);
    auto& runs = seqs_[device];
    auto it = std::find_if(runs.begin(), runs.end(),
                           [&](const auto& r) { return r.first == run_id; });
    if (it == runs.end()) {
      // Executions of one device may overlap on the CPU runtime, so a few
      // run ids are kept; older ones are finished and forgotten, which bounds
      // the map across runs.
      runs.emplace_front(run_id,
                         std::map<std::pair<int64_t, int64_t>, int64_t>());
      if (runs.size() > kRunsKept) runs.pop_back();
      it = runs.begin();
    }
    return it->second[{site, instance}]++;
  }

  // What Join found.
  struct Joined {
    std::shared_ptr<Inv> inv;  // the invocation of the key
    // Non-empty: this rank must not join, because a stall on its devices
    // makes them refuse starts for a while (stall_breaker.h), or because
    // its execution already failed on this device or on a peer's; the
    // reason.
    std::string refused;
  };

  // Rank `rank` joins the invocation of `key` (created by the first rank
  // to arrive), unless its group's devices refuse starts, or its own part
  // of the execution or that of a rank yet to join already failed
  // (NoteFailure).
  Joined Join(const Key& key, const std::shared_ptr<const Plan>& plan,
              int64_t row_bytes, int64_t rank) {
    std::lock_guard<SpinMutex> lock(mu_);
    Joined j;
    auto it = pending_.find(key);
    if (it != pending_.end()) {
      j.inv = it->second;
    } else {
      SweepLocked();
      j.inv = std::make_shared<Inv>(key, plan, row_bytes);
      pending_.emplace(key, j.inv);
    }
    // A late arriver at an abandoned invocation fails at once anyway.
    if (j.inv->failed()) return j;
    const auto device = static_cast<int32_t>(
        plan->devices[key.group * plan->axis_size + rank]);
    if (const Failure* f = FindFailureLocked(device, key.run_id)) {
      j.refused = "not started: this device's part of the execution already"
                  " failed in another copy-engine op" +
                  (f->second.empty() ? "" : ": " + f->second);
      return j;
    }
    // A peer that failed in this execution before joining never will: fail
    // now rather than wait for it until the timeout.
    if (!failed_runs_.empty()) {
      const auto group = GroupOf(*plan, key.group);
      for (size_t r = 0; r < group.size(); ++r) {
        if (j.inv->joined[r]) continue;
        const auto peer = static_cast<int32_t>(group[r]);
        if (const Failure* f = FindFailureLocked(peer, key.run_id)) {
          j.refused = "not started: rank " + std::to_string(r) +
                      " (device " + std::to_string(peer) +
                      ") of its group failed in this execution before"
                      " reaching this op" +
                      (f->second.empty() ? "" : ": " + f->second);
          return j;
        }
      }
    }
    const auto now = Clock::now();
    if (breaker_.MayRefuse(now)) {
      j.refused = breaker_.Refusal(GroupOf(*plan, key.group), now);
    }
    if (j.refused.empty()) j.inv->joined[rank] = true;
    return j;
  }

  // `device`'s part of execution `run_id` failed in a handler, saying
  // `why` (kept where the first note had no message). That part starts no
  // handler after it (an execution stops at its first error), though
  // XLA:CPU may already be running others of it at once: its starts still
  // under way are refused (Join) and register nothing (Register,
  // PushArmed), and DropRun takes what it registered before. Keyed by the
  // execution, not the site: on XLA:CPU executions of one program overlap
  // on a device, so another execution's entries at the same site may still
  // be waited for.
  void NoteFailure(int32_t device, int64_t run_id, const std::string& why = "") {
    std::lock_guard<SpinMutex> lock(mu_);
    breaker_.NoteFailure(device, run_id);
    auto& failed = failed_runs_[device];
    auto it = std::find_if(failed.begin(), failed.end(),
                           [&](const auto& f) { return f.first == run_id; });
    if (it == failed.end()) {
      failed.emplace_front(run_id, why);
      if (failed.size() > kRunsKept) failed.pop_back();
    } else if (it->second.empty()) {
      it->second = why;
    }
  }

  // Why `device`'s part of execution `run_id` failed (NoteFailure), or
  // nullopt if it did not.
  std::optional<std::string> RunFailure(int32_t device, int64_t run_id) {
    std::lock_guard<SpinMutex> lock(mu_);
    const auto* f = FindFailureLocked(device, run_id);
    if (f == nullptr) return std::nullopt;
    return f->second;
  }

  // A wait or done registration that DropRun took: `rank`'s wait for
  // landing buffer `landing`, or its done (`landing` < 0).
  struct Dropped {
    std::shared_ptr<Inv> inv;
    int64_t rank = 0;
    int64_t landing = -1;
  };

  // Unregisters what `device` registered in execution `run_id`, which
  // failed there (NoteFailure), and returns its waits and dones: their
  // copies may still write this device's landing buffers or read its
  // sources, which XLA frees once the failure surfaces, so the failing
  // handler awaits them first where it can (peer_copy_drain.h).
  std::vector<Dropped> DropRun(int32_t device, int64_t run_id) {
    std::vector<Armed> disarmed;
    std::vector<Dropped> dropped;
    {
      std::lock_guard<SpinMutex> lock(mu_);
      const AddrKey from{device, run_id, 0}, to{device, run_id, UINTPTR_MAX};
      for (auto* index : {&waits_, &dones_}) {
        const auto first = index->lower_bound(from);
        const auto last = index->upper_bound(to);
        for (auto it = first; it != last; ++it) {
          for (auto& [inv, n] : it->second) {
            if (index == &dones_) {
              dropped.push_back({inv, n, -1});
              continue;
            }
            int64_t rank = 0;
            while (inv->ranks[rank].device != device) ++rank;
            dropped.push_back({inv, rank, n});
          }
        }
        index->erase(first, last);
      }
      auto a = armed_.lower_bound({device, run_id, INT64_MIN});
      while (a != armed_.end() && std::get<0>(a->first) == device &&
             std::get<1>(a->first) == run_id) {
        for (Armed& armed : a->second) disarmed.push_back(std::move(armed));
        a = armed_.erase(a);
      }
    }
    // Outside the lock: the pools take locks of their own.
    for (const Armed& a : disarmed) Backend::ReleaseEvent(device, a.ready);
    return dropped;
  }

  // For a timeout's message: where `device`, which never started an op of
  // execution `run_id`, is instead.
  std::string Whereabouts(int32_t device, int64_t run_id) {
    std::lock_guard<SpinMutex> lock(mu_);
    for (const auto& [k, inv] : pending_) {
      if (k.run_id == run_id || inv->failed()) continue;
      const auto group = GroupOf(*inv->plan, k.group);
      const auto r = std::find(group.begin(), group.end(), device);
      if (r == group.end() || !inv->joined[r - group.begin()]) continue;
      return "device " + std::to_string(device) + " waits in '" +
             inv->plan->op_name + "' (site " + std::to_string(k.site) +
             ") of '" + inv->plan->program + "' (execution " +
             std::to_string(k.run_id) + ")";
    }
    return "device " + std::to_string(device) +
           " is in no copy-engine op: its part has not reached this one"
           " (still computing, failed, or held back by XLA behind another"
           " program)";
  }

  // A rendezvous timed out for ranks that never started (stall_breaker.h).
  void Stalled(const std::vector<int64_t>& group,
               const std::vector<int64_t>& missing, int64_t run_id,
               const std::string& why) {
    std::lock_guard<SpinMutex> lock(mu_);
    breaker_.Stalled(group, missing, run_id, why, Clock::now());
  }

  // The devices of group `group` of `plan`, by rank.
  static std::vector<int64_t> GroupOf(const Plan& plan, int64_t group) {
    const int64_t p = plan.axis_size;
    return std::vector<int64_t>(plan.devices.begin() + group * p,
                                plan.devices.begin() + (group + 1) * p);
  }

  // Drops `key` from the rendezvous once every rank arrived, or once every
  // rank that arrived at an abandoned invocation has left.
  void Forget(const Key& key, const Inv* inv) {
    std::lock_guard<SpinMutex> lock(mu_);
    auto it = pending_.find(key);
    if (it != pending_.end() && it->second.get() == inv) pending_.erase(it);
  }

  // At start: wait finds the invocation by the address of a landing buffer,
  // done by the address of sources[0]. Nothing for an execution that
  // already failed on `device` (NoteFailure): its waits and done will not
  // come.
  void Register(int32_t device, int64_t run_id,
                const std::shared_ptr<Inv>& inv, int64_t rank) {
    std::lock_guard<SpinMutex> lock(mu_);
    if (RunFailedLocked(device, run_id)) return;
    const auto& r = inv->ranks[rank];
    for (size_t b = 0; b < r.landings.size(); ++b) {
      waits_[{device, run_id, Addr(r.landings[b])}].push_back(
          {inv, static_cast<int64_t>(b)});
    }
    dones_[{device, run_id, Addr(r.sources[0])}].push_back({inv, rank});
  }

  // The oldest pending start of this device and execution whose landing
  // buffer `b` is at `address`; removes it.
  bool TakeWait(int32_t device, int64_t run_id, const void* address,
                std::shared_ptr<Inv>* inv, int64_t* landing) {
    std::lock_guard<SpinMutex> lock(mu_);
    auto it = waits_.find({device, run_id, Addr(address)});
    if (it == waits_.end()) return false;
    *inv = it->second.front().first;
    *landing = it->second.front().second;
    it->second.pop_front();
    if (it->second.empty()) waits_.erase(it);
    return true;
  }

  // The oldest pending start of this device and execution whose sources[0]
  // is keepalive[0] and whose forwarded landing buffers are all kept alive.
  // Matching the forwarded buffers too tells apart two invocations that
  // gather the same operand.
  bool TakeDone(int32_t device, int64_t run_id,
                const std::vector<const void*>& keepalive,
                std::shared_ptr<Inv>* inv, int64_t* rank) {
    std::lock_guard<SpinMutex> lock(mu_);
    auto it = dones_.find({device, run_id, Addr(keepalive[0])});
    if (it == dones_.end()) return false;
    auto& candidates = it->second;
    for (auto c = candidates.begin(); c != candidates.end(); ++c) {
      if (!KeepsForwardedAlive(*c->first, c->second, keepalive)) continue;
      *inv = c->first;
      *rank = c->second;
      candidates.erase(c);
      if (candidates.empty()) dones_.erase(it);
      return true;
    }
    return false;
  }

  // Removes what `device` registered for `inv`: its execution failed, so its
  // waits and done will never run.
  void ForgetDevice(int32_t device, const Inv* inv) {
    std::lock_guard<SpinMutex> lock(mu_);
    EraseIf(waits_, [&](const auto& key, const auto& e) {
      return std::get<0>(key) == device && e.first.get() == inv;
    });
    EraseIf(dones_, [&](const auto& key, const auto& e) {
      return std::get<0>(key) == device && e.first.get() == inv;
    });
  }

  int64_t Pending() {
    std::lock_guard<SpinMutex> lock(mu_);
    size_t n = pending_.size();
    for (const auto& [k, v] : waits_) n += v.size();
    for (const auto& [k, v] : dones_) n += v.size();
    return static_cast<int64_t>(n);
  }

 private:
  static constexpr size_t kRunsKept = 64;
  using AddrKey = std::tuple<int32_t, int64_t, uintptr_t>;
  template <class T>
  using Index = std::map<AddrKey, std::deque<std::pair<std::shared_ptr<Inv>, T>>>;

  static uintptr_t Addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

  using Failure = std::pair<int64_t, std::string>;  // run id, why

  const Failure* FindFailureLocked(int32_t device, int64_t run_id) const {
    auto it = failed_runs_.find(device);
    if (it == failed_runs_.end()) return nullptr;
    for (const Failure& f : it->second) {
      if (f.first == run_id) return &f;
    }
    return nullptr;
  }
  bool RunFailedLocked(int32_t device, int64_t run_id) const {
    return FindFailureLocked(device, run_id) != nullptr;
  }

  static bool KeepsForwardedAlive(const Inv& inv, int64_t rank,
                                  const std::vector<const void*>& keepalive) {
    const auto& r = inv.ranks[rank];
    for (const Transfer& t : inv.plan->transfers) {
      if (t.src >= 0) continue;
      const void* forwarded = r.landings[-1 - t.src];
      if (std::find(keepalive.begin(), keepalive.end(), forwarded) ==
          keepalive.end()) {
        return false;
      }
    }
    return true;
  }

  template <class Map, class Pred>
  static void EraseIf(Map& map, Pred pred) {
    for (auto it = map.begin(); it != map.end();) {
      auto& q = it->second;
      q.erase(std::remove_if(q.begin(), q.end(),
                             [&](const auto& e) { return pred(it->first, e); }),
              q.end());
      it = q.empty() ? map.erase(it) : std::next(it);
    }
  }

  // Entries of failed invocations whose device's execution aborted before
  // reaching wait/done (an error elsewhere in the program) would stay
  // forever; drop them once every bounded wait on them has expired.
  void SweepLocked() {
    const auto now = Clock::now();
    auto stale = [&](const Inv& inv) {
      return inv.failed() &&
             now - inv.failed_at >
                 std::chrono::milliseconds(2 * inv.plan->timeout_ms);
    };
    auto stale_entry = [&](const auto&, const auto& e) { return stale(*e.first); };
    EraseIf(waits_, stale_entry);
    EraseIf(dones_, stale_entry);
    for (auto it = pending_.begin(); it != pending_.end();) {
      it = stale(*it->second) ? pending_.erase(it) : std::next(it);
    }
  }

  std::map<std::tuple<int32_t, int64_t, int64_t>, std::deque<Armed>> armed_;
  HostStats stats_;
  std::atomic<int> mode_{Backend::DefaultIssueMode()};
  SpinMutex mu_;  // Short sections, taken by every device's threads.
  std::map<Key, std::shared_ptr<Inv>> pending_;
  Index<int64_t> waits_;  // -> landing buffer index
  Index<int64_t> dones_;  // -> rank
  // device -> recent runs -> (site, instance) -> starts so far.
  std::unordered_map<
      int32_t,
      std::deque<std::pair<int64_t, std::map<std::pair<int64_t, int64_t>,
                                             int64_t>>>>
      seqs_;
  // Per device, its most recent executions that failed in a handler
  // (NoteFailure); older ones have long stopped running handlers.
  std::unordered_map<int32_t, std::deque<Failure>> failed_runs_;
  StallBreaker breaker_;
};

}  // namespace ficco

#endif  // FICCO_XLA_FFI_PEER_COPY_REGISTRY_H_
