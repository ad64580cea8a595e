// Issue modes of the rendezvous transport (docs/protocol.md, "Three ways
// to issue"), and the per-device issuer threads of the asynchronous one.

#ifndef FICCO_XLA_FFI_ISSUER_H_
#define FICCO_XLA_FFI_ISSUER_H_

#include <pthread.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "task_thread.h"

namespace ficco {

// Who enqueues an invocation's copies (values of the C API, ficco_ffi.h).
enum IssueMode : int {
  // The last rank to arrive issues every rank's copies; start never waits.
  kIssueLast = 0,
  // Each rank waits in start for its peers, then issues what it receives.
  kIssueParallel = 1,
  // start only publishes; a thread of ficco's own per device waits for the
  // peers and issues what the device receives, off XLA's thread.
  kIssueAsync = 2,
};

inline const char* IssueModeName(int mode) {
  switch (mode) {
    case kIssueLast: return "last";
    case kIssueParallel: return "parallel";
    case kIssueAsync: return "async";
  }
  return "?";
}

// One device's issuer. It spins for a while after each task before it
// sleeps: back-to-back ops hand it a task every few tens of microseconds,
// and a sleeping thread takes tens of microseconds to wake.
inline constexpr std::chrono::microseconds kIssuerSpin{500};

// Names the calling issuer thread "ficco-issue-<device>", so /proc and
// profilers tell it apart from XLA's threads.
inline void NameIssuer(int32_t device) {
  const std::string name = "ficco-issue-" + std::to_string(device);
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

// Issuers are created on first use and leaked: their detached threads must
// never see their state destroyed at interpreter exit. One per (Backend,
// device), so the CPU twin and CUDA never share a thread. Each first runs
// Backend::BindIssuer(device): the thread is ficco's own, so CUDA makes the
// device current once instead of setting and restoring it around every
// enqueue (on 4xH200 that takes the issue section of a short op's
// start from ~40 to ~25 us).
template <class Backend>
TaskThread& IssuerOf(int32_t device) {
  // A per-thread memo first: every async start looks its issuer up, and the
  // four devices' threads would contend for the lock below.
  thread_local std::map<int32_t, TaskThread*> memo;
  if (auto it = memo.find(device); it != memo.end()) return *it->second;
  static std::mutex* mu = new std::mutex();
  static auto* issuers = new std::map<int32_t, TaskThread*>();
  std::lock_guard<std::mutex> lock(*mu);
  TaskThread*& q = (*issuers)[device];
  if (q == nullptr) {
    q = new TaskThread(kIssuerSpin);
    q->Push([device] {
      NameIssuer(device);
      Backend::BindIssuer(device);
    });
  }
  memo.emplace(device, q);
  return *q;
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_ISSUER_H_
