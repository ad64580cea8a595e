// Issue modes of the peer-copy protocol (PROTOCOL.md, "Three ways to
// issue"), and the per-device issuer threads of the asynchronous one.

#ifndef FICCO_XLA_FFI_ISSUER_H_
#define FICCO_XLA_FFI_ISSUER_H_

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "env.h"
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

// The mode named by environment variable `var` (last, parallel, async), or
// `fallback` if it is unset; a value naming none is logged, not ignored.
inline int IssueModeFromEnv(const char* var, int fallback) {
  const char* v = std::getenv(var);
  if (v == nullptr) return fallback;
  const std::string s(v);
  for (int mode : {kIssueLast, kIssueParallel, kIssueAsync}) {
    if (s == IssueModeName(mode)) return mode;
  }
  std::fprintf(stderr,
               "ficco: %s=%s names no issue mode (last, parallel, async);"
               " using %s\n",
               var, v, IssueModeName(fallback));
  return fallback;
}

// One device's issuer. It spins for a while after each task before it
// sleeps: back-to-back ops hand it a task every few tens of microseconds.
// 500 us, or FICCO_ISSUER_SPIN_US (read once; for measurements).
inline std::chrono::microseconds IssuerSpin() {
  static const std::chrono::microseconds spin =
      MicrosFromEnv("FICCO_ISSUER_SPIN_US", 500);
  return spin;
}

// Names the calling issuer thread "ficco-issue-<device>" (so /proc and
// profilers tell it apart) and, if FICCO_ISSUER_CPUS lists CPUs ("4,5,6,7"),
// pins it to entry `device % n` of the list. Pinning is for measurements of
// where host-bound ops lose time (benchmarks/host_timeline.py); a list that
// does not parse, or a CPU the process may not use, is logged and ignored.
inline void NameAndPinIssuer(int32_t device) {
  const std::string name = "ficco-issue-" + std::to_string(device);
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  const char* v = std::getenv("FICCO_ISSUER_CPUS");
  if (v == nullptr || *v == '\0') return;
  std::vector<int> cpus;
  const std::string list(v);
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    char* end = nullptr;
    const std::string item = list.substr(at, comma - at);
    const long cpu = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || cpu < 0 || cpu >= CPU_SETSIZE) {
      std::fprintf(stderr,
                   "ficco: FICCO_ISSUER_CPUS=%s is not a list of CPU numbers;"
                   " issuers stay unpinned\n", v);
      return;
    }
    cpus.push_back(static_cast<int>(cpu));
    at = comma + 1;
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpus[device % cpus.size()], &set);
  if (int err = pthread_setaffinity_np(pthread_self(), sizeof(set), &set)) {
    std::fprintf(stderr, "ficco: pinning %s to CPU %d failed (error %d)\n",
                 name.c_str(), cpus[device % cpus.size()], err);
  }
}

// Issuers are created on first use and leaked: their detached threads must
// never see their state destroyed at interpreter exit. One per (Backend,
// device), so the CPU twin and CUDA never share a thread. Each first runs
// Backend::BindIssuer(device): the thread is ficco's own, so CUDA makes the
// device current once instead of setting and restoring it around every
// enqueue (the issue section of a direct/c1/dma start fell from 39.5 to
// 25.5 us on 4xH200: benchmarks/results/h200x4_session10_a).
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
    q = new TaskThread(IssuerSpin());
    q->Push([device] {
      NameAndPinIssuer(device);
      Backend::BindIssuer(device);
    });
  }
  memo.emplace(device, q);
  return *q;
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_ISSUER_H_
