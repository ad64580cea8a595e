// Probe of the copy engines' behaviour under the access patterns of the
// reduce-scatter's dataflows, and of the host cost of enqueueing copies while
// other threads launch kernels. Run on the 4-GPU machine before changing the
// protocol's copy direction or copy call (benchmarks/gpu_session57.sh).
//
//   nvcc -O2 -std=c++17 -o /tmp/copy_probe xla_ffi/tools/copy_probe.cu
//   /tmp/copy_probe bw 16     # bandwidth per pattern, 16 MiB per transfer
//   /tmp/copy_probe host      # host us per enqueue, alone and contended
//
// bw: every GPU d takes part in the same pattern at once (as in the direct
// reduce-scatter, where each step is a permutation of the devices):
//   pull: the copy is enqueued on a stream of the receiving GPU (its copy
//         engine reads the peer's memory: ficco's protocol today);
//   push: on a stream of the sending GPU (its copy engine writes the peer's).
// "shifts a,b" receive from d+a and d+b; "||" on separate streams (at once),
// ";" on one stream (one after the other).
//
// host: per device, a launcher thread launching an empty kernel and an
// issuer thread enqueueing (wait event, 4 KiB peer copy, record event), the
// shape of one async-issue transfer; time per enqueue, each alone and both
// at once, for cudaMemcpyAsync(Default), cudaMemcpyPeerAsync and the driver's
// cuMemcpyDtoDAsync.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define CK(x)                                                            \
  do {                                                                   \
    cudaError_t e = (x);                                                 \
    if (e != cudaSuccess) {                                              \
      std::printf("FAIL %s: %s (line %d)\n", #x, cudaGetErrorString(e), \
                  __LINE__);                                             \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

using Clock = std::chrono::steady_clock;
static double Us(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

__global__ void Empty() {}

static int P = 0;
static const int kMaxStreams = 3;
static std::vector<std::vector<cudaStream_t>> streams;  // [device][k]

static void EnablePeers() {
  for (int d = 0; d < P; ++d) {
    CK(cudaSetDevice(d));
    for (int q = 0; q < P; ++q) {
      if (q == d) continue;
      cudaError_t st = cudaDeviceEnablePeerAccess(q, 0);
      if (st == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
      else CK(st);
    }
    streams.emplace_back();
    for (int k = 0; k < kMaxStreams; ++k) {
      cudaStream_t s;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      streams[d].push_back(s);
    }
  }
}

static void SyncAll() {
  for (int d = 0; d < P; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceSynchronize());
  }
}

struct Pattern {
  const char* name;
  std::vector<int> shifts;  // receive from d + shift
  bool push;
  bool one_stream;
};

static int Bw(size_t mib) {
  const size_t bytes = mib << 20;
  // src[d][k]: the piece d sends to shift k+1; dst[d][k]: what d receives.
  std::vector<std::vector<char*>> src(P), dst(P);
  for (int d = 0; d < P; ++d) {
    CK(cudaSetDevice(d));
    for (int k = 0; k < P - 1; ++k) {
      char* a; char* b;
      CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b, bytes));
      CK(cudaMemset(a, d + 1, bytes));
      src[d].push_back(a); dst[d].push_back(b);
    }
  }
  std::vector<Pattern> pats = {
      {"shift 1, pull", {1}, false, false},
      {"shift 1, push", {1}, true, false},
      {"shift 2, pull", {2}, false, false},
      {"shift 2, push", {2}, true, false},
      {"shift 3, pull", {3}, false, false},
      {"shift 3, push", {3}, true, false},
      {"shifts 2;1, pull", {2, 1}, false, true},
      {"shifts 1;3, pull", {1, 3}, false, true},
      {"shifts 1;3, push", {1, 3}, true, true},
      {"shifts 1||2, pull", {1, 2}, false, false},
      {"shifts 1||2, push", {1, 2}, true, false},
      {"shifts 1;2, pull", {1, 2}, false, true},
      {"shifts 1;2, push", {1, 2}, true, true},
      {"shifts 1||2||3, pull", {1, 2, 3}, false, false},
      {"shifts 1||2||3, push", {1, 2, 3}, true, false},
      {"shifts 1;2;3, pull", {1, 2, 3}, false, true},
      {"shifts 1;2;3, push", {1, 2, 3}, true, true},
  };
  std::printf("bw: %d GPUs, %zu MiB per transfer (median of 15 reps)\n", P, mib);
  std::printf("| pattern | us | GB/s into each GPU | GB/s per transfer |\n|---|---|---|---|\n");
  for (const Pattern& pat : pats) {
    if (static_cast<int>(pat.shifts.size()) > P - 1) continue;
    std::vector<double> times;
    for (int rep = 0; rep < 18; ++rep) {
      SyncAll();
      auto t0 = Clock::now();
      for (int d = 0; d < P; ++d) {  // d receives
        for (size_t k = 0; k < pat.shifts.size(); ++k) {
          const int q = (d + pat.shifts[k]) % P;  // from q
          const int owner = pat.push ? q : d;
          const int s = pat.one_stream ? 0 : static_cast<int>(k);
          CK(cudaSetDevice(owner));
          CK(cudaMemcpyAsync(dst[d][pat.shifts[k] - 1], src[q][pat.shifts[k] - 1], bytes, cudaMemcpyDefault,
                             streams[owner][s]));
        }
      }
      SyncAll();
      if (rep >= 3) times.push_back(Us(Clock::now() - t0));
    }
    std::sort(times.begin(), times.end());
    const double us = times[times.size() / 2];
    const double in_gbs = bytes * pat.shifts.size() / us / 1e3;
    const double per = pat.one_stream ? in_gbs : in_gbs / pat.shifts.size();
    std::printf("| %s | %.1f | %.0f | %.0f |\n", pat.name, us, in_gbs, per);
  }
  return 0;
}

using DtoDFn = CUresult (*)(CUdeviceptr, CUdeviceptr, size_t, CUstream);

static int Host() {
  const size_t bytes = 4096;
  const int iters = 4000;
  std::vector<char*> src(P), dst(P);
  std::vector<cudaEvent_t> ev(P);
  for (int d = 0; d < P; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaMalloc(&src[d], bytes)); CK(cudaMalloc(&dst[d], bytes));
    CK(cudaEventCreateWithFlags(&ev[d], cudaEventDisableTiming));
    CK(cudaEventRecord(ev[d], streams[d][1]));
  }
  cudaDriverEntryPointQueryResult q;
  void* fn = nullptr;
  CK(cudaGetDriverEntryPointByVersion("cuMemcpyDtoDAsync", &fn, 12000,
                                      cudaEnableDefault, &q));
  auto dtod = reinterpret_cast<DtoDFn>(fn);
  cudaStream_t launch_stream[16];
  for (int d = 0; d < P; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaStreamCreateWithFlags(&launch_stream[d], cudaStreamNonBlocking));
  }
  const char* modes[] = {"memcpyAsync", "memcpyPeerAsync", "cuMemcpyDtoDAsync"};
  std::printf("host: %d GPUs, us per enqueue (mean over %d per thread)\n", P, iters);
  std::printf("| copy call | launches alone | copies alone | launches, with copies | copies, with launches |\n|---|---|---|---|---|\n");
  for (int mode = 0; mode < 3; ++mode) {
    double res[4] = {0, 0, 0, 0};
    for (int cfg = 0; cfg < 3; ++cfg) {  // 0 launches, 1 copies, 2 both
      std::vector<std::thread> th;
      std::atomic<int> go{0};
      std::vector<double> launch_us(P, 0), copy_us(P, 0);
      for (int d = 0; d < P; ++d) {
        if (cfg != 1) th.emplace_back([&, d] {
          CK(cudaSetDevice(d));
          while (!go.load()) {}
          auto t0 = Clock::now();
          for (int i = 0; i < iters; ++i) {
            Empty<<<1, 32, 0, launch_stream[d]>>>();
            if (i % 256 == 255) CK(cudaStreamSynchronize(launch_stream[d]));
          }
          launch_us[d] = Us(Clock::now() - t0) / iters;
        });
        if (cfg != 0) th.emplace_back([&, d] {
          CK(cudaSetDevice(d));
          const int peer = (d + 1) % P;
          cudaStream_t s = streams[d][0];
          while (!go.load()) {}
          auto t0 = Clock::now();
          for (int i = 0; i < iters; ++i) {
            CK(cudaStreamWaitEvent(s, ev[peer], 0));
            if (mode == 0) {
              CK(cudaMemcpyAsync(dst[d], src[peer], bytes, cudaMemcpyDefault, s));
            } else if (mode == 1) {
              CK(cudaMemcpyPeerAsync(dst[d], d, src[peer], peer, bytes, s));
            } else {
              if (dtod(reinterpret_cast<CUdeviceptr>(dst[d]),
                       reinterpret_cast<CUdeviceptr>(src[peer]), bytes,
                       s) != CUDA_SUCCESS) {
                std::printf("FAIL cuMemcpyDtoDAsync\n"); std::exit(1);
              }
            }
            CK(cudaEventRecord(ev[d], streams[d][1]));
            if (i % 256 == 255) CK(cudaStreamSynchronize(s));
          }
          copy_us[d] = Us(Clock::now() - t0) / iters;
        });
      }
      go.store(1);
      for (auto& t : th) t.join();
      SyncAll();
      double l = 0, c = 0;
      for (int d = 0; d < P; ++d) { l += launch_us[d] / P; c += copy_us[d] / P; }
      if (cfg == 0) res[0] = l;
      if (cfg == 1) res[1] = c;
      if (cfg == 2) { res[2] = l; res[3] = c; }
    }
    std::printf("| %s | %.2f | %.2f | %.2f | %.2f |\n", modes[mode], res[0],
                res[1], res[2], res[3]);
  }
  return 0;
}

int main(int argc, char** argv) {
  CK(cudaGetDeviceCount(&P));
  if (P < 2) { std::printf("needs 2+ GPUs\n"); return 1; }
  EnablePeers();
  const std::string what = argc > 1 ? argv[1] : "bw";
  if (what == "bw") return Bw(argc > 2 ? std::atoi(argv[2]) : 16);
  if (what == "host") return Host();
  std::printf("usage: copy_probe bw [MiB] | host\n");
  return 1;
}
