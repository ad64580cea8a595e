// Probe for the symmetric (flag-based) transport, run once on the GPU machine
// before building on it: can a stream write a 32-bit flag into a peer GPU's
// memory (peer access, or CUDA IPC from another process) and can another
// stream wait on it (cuStreamWaitValue32)? What do a flag round trip and a
// flagged stage+pull cost?
//
//   nvcc -O2 -o /tmp/symm_probe xla_ffi/tools/symm_probe.cu
//   /tmp/symm_probe single                # every GPU of this process
//   CUDA_VISIBLE_DEVICES=0 /tmp/symm_probe ipc 0 /tmp/x &   # two processes
//   CUDA_VISIBLE_DEVICES=1 /tmp/symm_probe ipc 1 /tmp/x
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#define CK(x)                                                              \
  do {                                                                     \
    cudaError_t e = (x);                                                   \
    if (e != cudaSuccess) {                                                \
      std::printf("FAIL %s: %s (line %d)\n", #x, cudaGetErrorString(e),   \
                  __LINE__);                                               \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

using WriteFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned);
using WaitFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned);
static WriteFn g_write;
static WaitFn g_wait;

static void Load() {
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue32",
                                      (void**)&g_write, 12000,
                                      cudaEnableDefault, &q));
  CK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", (void**)&g_wait,
                                      12000, cudaEnableDefault, &q));
}
static void W(cudaStream_t s, void* p, unsigned v) {
  CUresult r = g_write((CUstream)s, (CUdeviceptr)p, v, 0);
  if (r) { std::printf("FAIL write %d\n", (int)r); std::exit(1); }
}
static void Wt(cudaStream_t s, void* p, unsigned v) {
  CUresult r = g_wait((CUstream)s, (CUdeviceptr)p, v, CU_STREAM_WAIT_VALUE_GEQ);
  if (r) { std::printf("FAIL wait %d\n", (int)r); std::exit(1); }
}
static double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr size_t kFlags = 4096;

static int Single() {
  int n; CK(cudaGetDeviceCount(&n));
  std::printf("devices %d\n", n);
  const size_t data = 64ull << 20;
  std::vector<char*> base(n);
  std::vector<cudaStream_t> st(n), pull(n);
  for (int d = 0; d < n; ++d) {
    CK(cudaSetDevice(d));
    for (int p = 0; p < n; ++p) if (p != d) CK(cudaDeviceEnablePeerAccess(p, 0));
    CK(cudaMalloc(&base[d], kFlags + 2 * data));
    CK(cudaMemset(base[d], 0, kFlags));
    CK(cudaMemset(base[d] + kFlags, d + 1, 2 * data));
    CK(cudaStreamCreateWithFlags(&st[d], cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&pull[d], cudaStreamNonBlocking));
  }
  for (int d = 0; d < n; ++d) { CK(cudaSetDevice(d)); CK(cudaDeviceSynchronize()); }
  auto flag = [&](int dev, int idx) { return (void*)(base[dev] + 4 * idx); };
  // Ping-pong between 0 and 1: remote writes, local waits.
  const int iters = 2000;
  double t0 = Now();
  for (int i = 1; i <= iters; ++i) {
    CK(cudaSetDevice(0)); W(st[0], flag(1, 0), i); Wt(st[0], flag(0, 1), i);
    CK(cudaSetDevice(1)); Wt(st[1], flag(1, 0), i); W(st[1], flag(0, 1), i);
  }
  CK(cudaSetDevice(0)); CK(cudaStreamSynchronize(st[0]));
  double rt = (Now() - t0) / iters;
  std::printf("single: flag round trip 0<->1 %.2f us (host enqueue incl.)\n", rt * 1e6);
  // Stage + flagged pulls: each device copies 16 MiB into its slot, signals
  // every peer, pulls each peer's slot after its flag, signals freed.
  for (size_t mib : {1, 4, 16, 64}) {
    const size_t bytes = mib << 20;
    std::vector<char*> land(n), src(n);
    for (int d = 0; d < n; ++d) {
      CK(cudaSetDevice(d));
      CK(cudaMalloc(&land[d], bytes * n)); CK(cudaMalloc(&src[d], bytes));
      CK(cudaMemset(src[d], 0x40 + d, bytes));
    }
    static unsigned epoch = 0;
    auto once = [&]() {
      ++epoch;
      for (int d = 0; d < n; ++d) {
        CK(cudaSetDevice(d));
        char* slot = base[d] + kFlags + (epoch % 2) * data;
        if (epoch > 2) for (int p = 0; p < n; ++p) if (p != d) Wt(st[d], flag(d, 64 + p), epoch - 2);
        CK(cudaMemcpyAsync(slot, src[d], bytes, cudaMemcpyDeviceToDevice, st[d]));
        for (int p = 0; p < n; ++p) if (p != d) W(st[d], flag(p, 32 + d), epoch);
        for (int p = 0; p < n; ++p) if (p != d) {
          Wt(pull[d], flag(d, 32 + p), epoch);
          CK(cudaMemcpyAsync(land[d] + p * bytes, base[p] + kFlags + (epoch % 2) * data,
                             bytes, cudaMemcpyDefault, pull[d]));
        }
        for (int p = 0; p < n; ++p) if (p != d) W(pull[d], flag(p, 64 + d), epoch);
      }
    };
    for (int i = 0; i < 5; ++i) once();
    for (int d = 0; d < n; ++d) { CK(cudaSetDevice(d)); CK(cudaDeviceSynchronize()); }
    const int reps = 50;
    double t = Now();
    for (int i = 0; i < reps; ++i) once();
    for (int d = 0; d < n; ++d) { CK(cudaSetDevice(d)); CK(cudaDeviceSynchronize()); }
    double per = (Now() - t) / reps;
    bool ok = true;
    std::vector<char> h(bytes);
    for (int d = 0; d < n && ok; ++d) for (int p = 0; p < n; ++p) if (p != d) {
      CK(cudaSetDevice(d));
      CK(cudaMemcpy(h.data(), land[d] + p * bytes, bytes, cudaMemcpyDeviceToHost));
      for (size_t k = 0; k < bytes; k += 4093) if (h[k] != (char)(0x40 + p)) { ok = false; break; }
    }
    std::printf("single: stage+pull %zu MiB/peer x%d peers: %.1f us/op, %.0f GB/s recv/GPU, data %s\n",
                mib, n - 1, per * 1e6, (n - 1) * bytes / per / 1e9, ok ? "OK" : "WRONG");
    for (int d = 0; d < n; ++d) { CK(cudaSetDevice(d)); CK(cudaFree(land[d])); CK(cudaFree(src[d])); }
  }
  return 0;
}

static int Ipc(int rank, const std::string& dir) {
  CK(cudaSetDevice(0));
  const size_t data = 64ull << 20;
  char* base; CK(cudaMalloc(&base, kFlags + data));
  CK(cudaMemset(base, 0, kFlags)); CK(cudaMemset(base + kFlags, 0x30 + rank, data));
  CK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t h; CK(cudaIpcGetMemHandle(&h, base));
  { std::ofstream f(dir + "/h" + std::to_string(rank) + ".tmp", std::ios::binary);
    f.write((char*)&h, sizeof h); }
  std::rename((dir + "/h" + std::to_string(rank) + ".tmp").c_str(),
              (dir + "/h" + std::to_string(rank)).c_str());
  int peer = 1 - rank; cudaIpcMemHandle_t ph; double t0 = Now();
  for (;;) {
    std::ifstream f(dir + "/h" + std::to_string(peer), std::ios::binary);
    if (f && f.read((char*)&ph, sizeof ph)) break;
    if (Now() - t0 > 30) { std::printf("FAIL no peer handle\n"); return 1; }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  char* pbase; double to = Now();
  CK(cudaIpcOpenMemHandle((void**)&pbase, ph, cudaIpcMemLazyEnablePeerAccess));
  std::printf("ipc rank %d: opened peer in %.1f ms\n", rank, (Now() - to) * 1e3);
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int iters = 2000; double t = Now();
  for (int i = 1; i <= iters; ++i) {
    if (rank == 0) { W(s, pbase, i); Wt(s, base + 4, i); }
    else { Wt(s, base, i); W(s, pbase + 4, i); }
  }
  CK(cudaStreamSynchronize(s));
  std::printf("ipc rank %d: flag round trip %.2f us\n", rank, (Now() - t) / iters * 1e6);
  char* land; CK(cudaMalloc(&land, data));
  W(s, pbase + 8, 1); Wt(s, base + 8, 1);  // Both sides ready to read.
  for (int i = 0; i < 3; ++i) CK(cudaMemcpyAsync(land, pbase + kFlags, data, cudaMemcpyDefault, s));
  CK(cudaStreamSynchronize(s)); t = Now();
  for (int i = 0; i < 20; ++i) CK(cudaMemcpyAsync(land, pbase + kFlags, data, cudaMemcpyDefault, s));
  CK(cudaStreamSynchronize(s)); double per = (Now() - t) / 20;
  std::vector<char> hb(data); CK(cudaMemcpy(hb.data(), land, data, cudaMemcpyDeviceToHost));
  bool ok = true; for (size_t k = 0; k < data; k += 4093) ok &= hb[k] == (char)(0x30 + peer);
  std::printf("ipc rank %d: pull 64 MiB %.1f us = %.0f GB/s, data %s\n", rank, per * 1e6,
              data / per / 1e9, ok ? "OK" : "WRONG");
  W(s, pbase + 12, 1); Wt(s, base + 12, 1);  // Peer done reading before exit.
  CK(cudaStreamSynchronize(s));
  CK(cudaIpcCloseMemHandle(pbase));
  return 0;
}

int main(int argc, char** argv) {
  Load();
  if (argc >= 2 && !std::strcmp(argv[1], "single")) return Single();
  if (argc >= 4 && !std::strcmp(argv[1], "ipc")) return Ipc(std::atoi(argv[2]), argv[3]);
  std::printf("usage: symm_probe single | ipc RANK DIR\n");
  return 2;
}
