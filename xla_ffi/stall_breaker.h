// After a rendezvous stalled, the copy-engine ops queued behind it on the
// same devices fail at once instead of each after its own timeout
// (docs/protocol.md, "Several dispatching threads").
//
// Why: when several host threads dispatch programs that share devices,
// XLA may run them in different orders on different devices. XLA:CPU does
// once a device has more calls in flight than it admits at once: the
// launches then wait per device, and whichever wakes first goes first. A
// rank then waits for a peer whose part XLA holds back behind the other
// program, a stall no handler can see before the timeout. With deep queues
// the orders keep diverging, so call after call would stall for its whole
// timeout: a loop that dispatches hundreds of calls looks hung, its errors
// sitting unread in the outputs of calls long past. So once a rendezvous
// timed out for ranks that never started, every start on those devices
// fails at once until none has come for kQuiet: the queued calls drain in
// milliseconds, and a call dispatched after that runs normally. Refusals
// end kMaxRefusing after the stall however many starts keep coming, so
// that a caller who retries (after jax.clear_caches(), say, or at once in
// a loop) gets through: at worst its next call stalls and trips it again.
//
// Guarded by the registry's lock (peer_copy_registry.h).

#ifndef FICCO_XLA_FFI_STALL_BREAKER_H_
#define FICCO_XLA_FFI_STALL_BREAKER_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dispatch_advice.h"

namespace ficco {

class StallBreaker {
 public:
  using Clock = std::chrono::steady_clock;

  // Long enough that the calls already queued (XLA starts the next one as
  // soon as the previous fails, then runs whatever precedes its first
  // copy-engine op) keep the devices refusing; short enough that a caller
  // who fixed the dispatch barely notices.
  static constexpr std::chrono::milliseconds kQuiet{1000};
  // The longest a stall makes its devices refuse, however many starts keep
  // extending it: past this, a start runs (and stalls again, or not).
  static constexpr std::chrono::milliseconds kMaxRefusing{5000};

  // `device`'s part of execution `run_id` failed in a handler (a timeout,
  // an error, the never-arrive test hook): its own error explains why its
  // peers stall, and they need not refuse the calls after it.
  void NoteFailure(int64_t device, int64_t run_id) {
    for (const auto& f : failures_) {
      if (f.first == device && f.second == run_id) return;
    }
    failures_.push_front({device, run_id});
    if (failures_.size() > kFailuresKept) failures_.pop_back();
  }

  // A rendezvous of execution `run_id` over `group` timed out for the ranks
  // on `missing`, which never started it: unless one of them failed in a
  // handler of that execution, the group's devices refuse starts from `now`
  // until kQuiet without one, for kMaxRefusing at most; `why` is the
  // stall, named in every refusal.
  void Stalled(const std::vector<int64_t>& group,
               const std::vector<int64_t>& missing, int64_t run_id,
               const std::string& why, Clock::time_point now) {
    for (int64_t d : missing) {
      for (const auto& f : failures_) {
        if (f.first == d && f.second == run_id) return;
      }
    }
    auto shared_why = std::make_shared<const std::string>(why);
    for (int64_t d : group) {
      State& s = devices_[d];
      if (s.why == nullptr || s.until <= now) s.why = shared_why;
      s.until = now + kQuiet;
      s.cap = now + kMaxRefusing;
    }
    if (latest_ < now + kQuiet) latest_ = now + kQuiet;
  }

  // Whether any device may refuse at `now`: false on every start's path
  // unless a stall or a refusal happened in the last kQuiet.
  bool MayRefuse(Clock::time_point now) const { return now < latest_; }

  // If a device of `group` refuses at `now`: every device of the group
  // refuses for another kQuiet (the queue is still draining), up to the
  // stall's kMaxRefusing, and the refusal's message; else empty.
  std::string Refusal(const std::vector<int64_t>& group,
                      Clock::time_point now) {
    std::shared_ptr<const std::string> why;
    Clock::time_point cap{};
    for (int64_t d : group) {
      auto it = devices_.find(d);
      if (it != devices_.end() && it->second.until > now) {
        why = it->second.why;
        cap = it->second.cap;
        break;
      }
    }
    if (why == nullptr) return "";
    const Clock::time_point until = std::min(now + kQuiet, cap);
    for (int64_t d : group) {
      State& s = devices_[d];
      if (s.why == nullptr || s.until <= now) {
        s.why = why;
        s.cap = cap;
      }
      if (s.until < until) s.until = until;
    }
    if (latest_ < until) latest_ = until;
    std::string list;
    for (int64_t d : group) list += (list.empty() ? "" : ", ") + std::to_string(d);
    return "not started: copy-engine ops on devices [" + list +
           "] fail at once until none has come for " +
           std::to_string(kQuiet.count()) + " ms (at most " +
           std::to_string(kMaxRefusing.count()) +
           " ms after the stall), so that the calls queued behind a stalled"
           " one fail now"
           " instead of each after its own timeout. The stall: " + *why +
           "; " + kIfSeveralDispatchers;
  }

 private:
  static constexpr size_t kFailuresKept = 64;  // older executions are over
  struct State {
    Clock::time_point until;  // refuses before this
    Clock::time_point cap;    // the stall's time + kMaxRefusing
    std::shared_ptr<const std::string> why;
  };

  std::unordered_map<int64_t, State> devices_;
  Clock::time_point latest_{};  // no device refuses from then on
  std::deque<std::pair<int64_t, int64_t>> failures_;  // (device, run id)
};

}  // namespace ficco

#endif  // FICCO_XLA_FFI_STALL_BREAKER_H_
