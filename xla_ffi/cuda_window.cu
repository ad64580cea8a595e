// CUDA handlers of the window and push transports (docs/windows.md):
// windows are cudaMalloc'd memory, mapped by peers through peer access (same
// process) or CUDA IPC (other processes); copies are cudaMemcpyAsync on side
// streams (copy engines); flags are written and awaited by the streams
// themselves (cuStreamWriteValue32 / cuStreamWaitValue32), so no host thread
// waits for a peer. A watchdog thread bounds every invocation: past its
// deadline it names the missing ranks, releases the stuck streams and
// poisons the window, so the next call fails instead of the process
// hanging.
//
// Host code only: nothing here runs on the GPU's SMs.

#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda_backend.h"
#include "cuda_util.h"
#include "dispatch_advice.h"
#include "event_pool.h"
#include "ficco_ffi.h"
#include "gather_push_protocol.h"
#include "gemm.h"
#include "peer_copy_registry.h"  // Clock, DeadlineAfter
#include "push_protocol.h"
#include "push_sum.h"
#include "window.h"
#include "window_protocol.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {
namespace {

constexpr int64_t kQueueBase = int64_t{1} << 32;

ffi::ErrorOr<cudaStream_t> QueueStream(int32_t device, int64_t queue) {
  return SideStream(device, kQueueBase + queue);
}

}  // namespace

// The window and push transports' queues: on the handler's device (it made
// that device current), on streams apart from the rendezvous transport's.
ffi::ErrorOr<cudaStream_t> CudaBackend::WindowStream(int32_t device,
                                                     int64_t queue) const {
  if (queue == kComputeQueue) return compute;
  return QueueStream(device, queue);
}

// One cuStreamBatchMemOp for the lot (same order and semantics as the
// single calls: waits are cyclic >=, writes fence the queue's earlier
// work).
ffi::Error CudaBackend::FlagOps(const std::shared_ptr<WindowInv>&,
                                int32_t device, int64_t queue,
                                const std::vector<FlagOp>& ops) {
  if (ops.empty()) return ffi::Error::Success();
  auto s = WindowStream(device, queue);
  if (!s.has_value()) return s.error();
  BatchMemOpFn batch = BatchMemOp();
  if (batch == nullptr) {
    return ffi::Error::Internal("the driver has no cuStreamBatchMemOp");
  }
  std::vector<CUstreamBatchMemOpParams> params(ops.size());
  std::memset(params.data(), 0, params.size() * sizeof(params[0]));
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto addr = reinterpret_cast<CUdeviceptr>(ops[i].addr);
    if (ops[i].write) {
      params[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      params[i].writeValue.address = addr;
      params[i].writeValue.value = ops[i].value;
      params[i].writeValue.flags = 0;
    } else {
      params[i].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
      params[i].waitValue.address = addr;
      params[i].waitValue.value = ops[i].value;
      params[i].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    }
  }
  return CheckCu(batch(reinterpret_cast<CUstream>(*s),
                       static_cast<unsigned int>(params.size()),
                       params.data(), 0),
                 "cuStreamBatchMemOp");
}

ffi::Error CudaBackend::Sum(const std::shared_ptr<WindowInv>&, int32_t device,
                            int64_t queue, ffi::DataType dtype, char* out,
                            const char* own, const char* landing,
                            int64_t chunks, int64_t peers,
                            int64_t chunk_elems) {
  auto s = WindowStream(device, queue);
  if (!s.has_value()) return s.error();
  return CudaPushSum(*s, PushSumArgs{dtype, out, own, landing, chunks,
                                     peers, chunk_elems});
}

ffi::Error CudaBackend::Gemm(const std::shared_ptr<WindowInv>&, int32_t device,
                             int64_t queue, const GemmArgs& g) {
  auto s = WindowStream(device, queue);
  if (!s.has_value()) return s.error();
  return CudaGemm(*s, device, g);
}

// The handler made `device` current; every queue is on it.
ffi::Error CudaBackend::WaitEvent(const std::shared_ptr<WindowInv>&,
                                  int32_t device, int64_t queue, Event* e) {
  auto s = WindowStream(device, queue);
  if (!s.has_value()) return s.error();
  FICCO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(*s, e, 0));
  return ffi::Error::Success();
}

ffi::Error CudaBackend::Copy(const std::shared_ptr<WindowInv>&, int32_t device,
                             int64_t queue, char* dst, const char* src,
                             size_t bytes) {
  if (bytes == 0) return ffi::Error::Success();
  auto s = WindowStream(device, queue);
  if (!s.has_value()) return s.error();
  // Unified addressing: a peer's window (peer access or IPC) is a device
  // pointer like any other, and the copy engine moves it over NVLink.
  FICCO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, *s));
  return ffi::Error::Success();
}

ffi::Error CudaBackend::Record(const std::shared_ptr<WindowInv>&,
                               int32_t device, int64_t queue, Event* e) {
  auto s = WindowStream(device, queue);
  if (!s.has_value()) return s.error();
  FICCO_CUDA_RETURN_IF_ERROR(cudaEventRecord(e, *s));
  return ffi::Error::Success();
}

ffi::Error CudaBackend::WaitFlag(const std::shared_ptr<WindowInv>&,
                                 int32_t device, int64_t queue, uint32_t* addr,
                                 uint32_t value, const std::string&) {
  auto s = WindowStream(device, queue);
  if (!s.has_value()) return s.error();
  return CheckCu(Ops().wait(reinterpret_cast<CUstream>(*s),
                            reinterpret_cast<CUdeviceptr>(addr), value,
                            CU_STREAM_WAIT_VALUE_GEQ),
                 "cuStreamWaitValue32");
}

// The default flags fence the stream's earlier writes (the staged data)
// before the flag, system-wide.
ffi::Error CudaBackend::WriteFlag(const std::shared_ptr<WindowInv>&,
                                  int32_t device, int64_t queue, uint32_t* addr,
                                  uint32_t value) {
  auto s = WindowStream(device, queue);
  if (!s.has_value()) return s.error();
  return CheckCu(Ops().write(reinterpret_cast<CUstream>(*s),
                             reinterpret_cast<CUdeviceptr>(addr), value, 0),
                 "cuStreamWriteValue32");
}

namespace {

using Inv = WindowInvocation<CudaBackend>;

// Bounds every invocation after its done: polls its events; past the
// deadline it reads the window's flags to name the ranks that never
// signalled, writes them itself so the streams blocked on them drain (the
// data is garbage, and the window is poisoned so the next call says so), and
// prints the failure.
class Watchdog {
 public:
  static Watchdog& Get() {
    static Watchdog* w = new Watchdog();  // Leaked: its thread never ends.
    return *w;
  }
  void Watch(std::shared_ptr<Inv> inv) {
    const auto deadline = DeadlineAfter(inv->plan.timeout_ms);
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back({std::move(inv), deadline});
    }
    cv_.notify_one();
  }
 private:
  struct Entry {
    std::shared_ptr<Inv> inv;
    Clock::time_point deadline;
  };
  Watchdog() { std::thread([this] { Run(); }).detach(); }

  [[noreturn]] void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (pending_.empty()) {
        cv_.wait(lock);
        continue;
      }
      std::deque<Entry> batch;
      batch.swap(pending_);
      lock.unlock();
      std::deque<Entry> keep;
      for (Entry& e : batch) {
        if (!Finished(e)) keep.push_back(std::move(e));
      }
      // Polling is cheap next to the ops it watches (each is tens of us or
      // more), and bounded to one query per event per millisecond.
      if (!keep.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      lock.lock();
      for (Entry& e : keep) pending_.push_front(std::move(e));
    }
  }

  // True when the entry can go: its events completed, or it timed out and
  // was dealt with.
  bool Finished(Entry& e) {
    Inv& inv = *e.inv;
    cudaSetDevice(inv.win->device);
    bool done = true;
    for (CUevent_st* ev : {inv.staged, inv.signalled}) {
      const cudaError_t s = cudaEventQuery(ev);
      if (s == cudaErrorNotReady) {
        done = false;
      } else if (s != cudaSuccess) {
        inv.Fail(inv.where + ": a copy failed: " + cudaGetErrorString(s));
      }
    }
    if (done) return true;
    if (Clock::now() < e.deadline) return false;
    Rescue(inv);
    return true;
  }

  void Rescue(Inv& inv) {
    Window& w = *inv.win;
    std::vector<uint32_t> header(2 * kMaxRanks, 0);
    cudaStream_t s = nullptr;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaMemcpyAsync(header.data(), w.base, kHeaderBytes,
                    cudaMemcpyDeviceToHost, s);
    cudaStreamSynchronize(s);
    const std::string missing =
        Unsignalled(w, header.data(), inv.epoch, inv.freed_lag);
    const std::string why =
        inv.where + ": timed out after " +
        std::to_string(inv.plan.timeout_ms) + " ms; " +
        (missing.empty() ? QueuedBehind(inv) : NeverSignalled(missing));
    inv.Fail(why);
    std::fprintf(stderr, "ficco: %s\n", why.c_str());
    // Release every stream still waiting on this window's flags.
    const uint32_t top = w.epoch.load();
    for (int64_t q = 0; q < w.size; ++q) {
      Ops().write(reinterpret_cast<CUstream>(s),
                  reinterpret_cast<CUdeviceptr>(w.ReadyOf(w.base, q)), top, 0);
      Ops().write(reinterpret_cast<CUstream>(s),
                  reinterpret_cast<CUdeviceptr>(w.FreedOf(w.base, q)), top, 0);
    }
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> pending_;
};

ffi::Error Sticky(const Window& w, std::string_view phase,
                  std::string_view op, int32_t device) {
  std::string sticky = w.Sticky();
  if (sticky.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                    "ficco window " + std::string(phase) + " of '" +
                        std::string(op) + "' on device " +
                        std::to_string(device) + ": " + sticky);
}

ffi::Error StartImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                     ffi::RemainingArgs args, ffi::RemainingRets rets,
                     Attrs attrs) {
  if (Ops().write == nullptr) return ffi::Error::Internal(Ops().error);
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  CudaBackend backend(stream);
  return WindowStart(backend, run_id.run_id, /*instance=*/0, device, args,
                     rets, attrs);
}

// A wait or done that fails once it has found its invocation, a push
// all-gather or push start that fails once its pushes may be enqueued, or a
// push finish once it holds its start's invocation (their `drain`). XLA
// frees the execution's buffers when it sees the error, and later work on
// its stream may reuse them while this invocation's copies still read or
// write them.
// So the invocation fails first (its issuer enqueues no more copies, and the
// window is poisoned), XLA's stream then waits for every copy already
// enqueued, and the watchdog releases any copy stuck on a peer's flag at the
// deadline. The CPU twin's counterpart is FailSettled (cpu_window.cc).
ffi::Error FailDrained(cudaStream_t stream, int32_t device,
                       std::shared_ptr<Inv> inv, ffi::Error error,
                       const std::string& who) {
  // The other invocations this execution started here fail with it: their
  // waits and dones will never come, and their copies use its buffers too.
  auto run = WindowIndex<CudaBackend>::Get().FailRun(
      inv, inv->where + ": " + std::string(error.message()));
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  for (std::shared_ptr<Inv>& r : run) {
    // Once its issue has ended, every copy it enqueued has recorded its
    // event.
    (void)AwaitIssued(*r, who);
    for (CUevent_st* e : r->AllEvents()) {
      if (e != nullptr) cudaStreamWaitEvent(stream, e, 0);
    }
    Watchdog::Get().Watch(std::move(r));
  }
  return error;
}

ffi::Error Refused(std::string_view phase, std::string_view op,
                   int32_t device) {
  return ffi::Error(ffi::ErrorCode::kUnavailable,
                    WindowWho(phase, op, device) +
                        ": refused by the fault test hook");
}

ffi::Error WaitImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                    ffi::AnyBuffer buf,
                    ffi::Result<ffi::AnyBuffer> out, Attrs attrs) {
  if (buf.untyped_data() != out->untyped_data()) {
    return ffi::Error::Internal("ficco window wait: output not aliased");
  }
  auto [inv, landing] = WindowIndex<CudaBackend>::Get().TakeWait(
      attrs.window, device, buf.untyped_data(), run_id.run_id);
  const std::string who = WindowWho("wait", attrs.op_name, device);
  if (Faults(device, kFaultWait)) {
    ffi::Error refused = Refused("wait", attrs.op_name, device);
    if (!inv) return refused;
    return FailDrained(stream, device, std::move(inv), std::move(refused), who);
  }
  if (!inv) {
    return WindowMissError<CudaBackend>(attrs.window, "wait",
                                              attrs.op_name, device);
  }
  if (auto err = Sticky(*inv->win, "wait", attrs.op_name, device);
      err.failure()) {
    return FailDrained(stream, device, std::move(inv), std::move(err), who);
  }
  if (auto err = AwaitIssued(*inv, who); err.failure()) {
    return FailDrained(stream, device, std::move(inv), std::move(err), who);
  }
  // A landed wait only host-orders the kernel after it, which waits on the
  // landing flags on the device: their writes are enqueued now.
  if (attrs.landed) return ffi::Error::Success();
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  for (size_t i = 0; i < inv->plan.transfers.size(); ++i) {
    if (inv->plan.transfers[i].dst != landing) continue;
    FICCO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, inv->arrival[i], 0));
  }
  return ffi::Error::Success();
}

ffi::Error DoneImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                    ffi::AnyBuffer out_in,
                    ffi::RemainingArgs keepalive,
                    ffi::Result<ffi::AnyBuffer> out, Attrs attrs) {
  if (out_in.untyped_data() != out->untyped_data()) {
    return ffi::Error::Internal("ficco window done: output not aliased");
  }
  auto first = keepalive.get<ffi::AnyBuffer>(0);
  if (!first.has_value()) return first.error();
  auto inv = WindowIndex<CudaBackend>::Get().TakeDone(
      attrs.window, device, first->untyped_data(), run_id.run_id);
  const std::string who = WindowWho("done", attrs.op_name, device);
  if (Faults(device, kFaultDone)) {
    ffi::Error refused = Refused("done", attrs.op_name, device);
    if (!inv) return refused;
    return FailDrained(stream, device, std::move(inv), std::move(refused), who);
  }
  if (!inv) {
    return WindowMissError<CudaBackend>(attrs.window, "done",
                                              attrs.op_name, device);
  }
  if (auto err = Sticky(*inv->win, "done", attrs.op_name, device);
      err.failure()) {
    return FailDrained(stream, device, std::move(inv), std::move(err), who);
  }
  if (auto err = AwaitIssued(*inv, who); err.failure()) {
    return FailDrained(stream, device, std::move(inv), std::move(err), who);
  }
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  // XLA may reuse the sources once they are staged; this rank's pulls are
  // already awaited by the waits (the finals cost nothing more).
  FICCO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, inv->staged, 0));
  for (CUevent_st* f : inv->finals) {
    FICCO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, f, 0));
  }
  Watchdog::Get().Watch(std::move(inv));
  return ffi::Error::Success();
}

ffi::Error PushArmImpl(cudaStream_t stream, ffi::RunId run_id,
                       int32_t device, ffi::AnyBuffer /*after*/,
                       ffi::Result<ffi::AnyBuffer> flags,
                       ffi::Result<ffi::AnyBuffer> rank, Attrs attrs) {
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  CudaBackend backend(stream);
  return PushArm(backend, run_id.run_id, device, *flags, *rank, attrs);
}

ffi::Error PushStartImpl(cudaStream_t stream, ffi::RunId run_id,
                         int32_t device, ffi::AnyBuffer parts,
                         ffi::AnyBuffer flags,
                         ffi::Result<ffi::AnyBuffer> flags_out,
                         Attrs attrs) {
  if (Ops().write == nullptr) return ffi::Error::Internal(Ops().error);
  if (flags.untyped_data() != flags_out->untyped_data()) {
    return ffi::Error::Internal("ficco push start: flags not aliased");
  }
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  CudaBackend backend(stream);
  std::shared_ptr<Inv> drain;
  ffi::Error err =
      PushStart(backend, run_id.run_id, /*instance=*/0, device, parts, flags,
                attrs, &drain);
  // Its side-stream pushes may still read parts, behind the kernel's and
  // the peers' flags: drained as a failing done is, or XLA could reuse
  // parts under them.
  if (err.failure() && drain != nullptr) {
    return FailDrained(stream, device, std::move(drain), std::move(err),
                       PushWho("start", attrs.op_name, device));
  }
  return err;
}

ffi::Error PushFinishImpl(cudaStream_t stream, int32_t device,
                          ffi::AnyBuffer parts, ffi::AnyBuffer /*flags*/,
                          ffi::Result<ffi::AnyBuffer> out,
                          Attrs attrs) {
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  CudaBackend backend(stream);
  std::shared_ptr<Inv> drain;
  auto inv = PushFinish(backend, device, parts, *out, attrs, &drain);
  if (!inv.has_value()) {
    // The start's pushes may still read parts, and XLA's stream may be
    // blocked on a peer's ready flag, which only the watchdog releases:
    // drained (and watched) as a failing done is.
    if (drain == nullptr) return inv.error();
    return FailDrained(stream, device, std::move(drain), inv.error(),
                       PushWho("finish", attrs.op_name, device));
  }
  // Bounds the invocation: past its deadline the watchdog names the ranks
  // that never pushed and releases the streams waiting on them.
  Watchdog::Get().Watch(std::move(*inv));
  return ffi::Error::Success();
}

ffi::Error PushGatherImpl(cudaStream_t stream, ffi::RunId run_id,
                          int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                          ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::AnyBuffer> gathered,
                          Attrs attrs) {
  if (Ops().write == nullptr) return ffi::Error::Internal(Ops().error);
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  CudaBackend backend(stream);
  std::shared_ptr<Inv> drain;
  auto inv = PushGather(backend, run_id.run_id, /*instance=*/0, device, x, w, *out,
                        *gathered, attrs, &drain);
  if (!inv.has_value()) {
    // Its side-stream copies may still write `gathered` and read x, and
    // XLA's stream may be blocked on a peer's flag: drained as a failing
    // done is, or XLA could reuse the buffers under them.
    if (drain == nullptr) return inv.error();
    return FailDrained(stream, device, std::move(drain), inv.error(),
                       PushWho("all-gather", attrs.op_name, device));
  }
  // Bounds the invocation: past its deadline the watchdog names the ranks
  // that never pushed and releases the streams waiting on them.
  Watchdog::Get().Watch(std::move(*inv));
  return ffi::Error::Success();
}

}  // namespace

ffi::Error CudaEnablePeer(int32_t device, int32_t peer_device) {
  ScopedDevice scoped;
  if (auto err = scoped.Set(device); err.failure()) return err;
  return EnablePeerAccess(device, peer_device);
}

// Handle: the CUDA IPC handle of the device memory, then the name of the
// host words' shared memory.
ffi::Error CudaWindowAllocate(Window& w, std::string* handle) {
  if (Ops().write == nullptr) return ffi::Error::Internal(Ops().error);
  ScopedDevice scoped;
  if (auto err = scoped.Set(w.device); err.failure()) return err;
  void* p = nullptr;
  FICCO_CUDA_RETURN_IF_ERROR(
      cudaMalloc(&p, kHeaderBytes + kHostBytes + kSlots * w.slot_bytes));
  FICCO_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0, kHeaderBytes));
  FICCO_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  cudaIpcMemHandle_t h;
  FICCO_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&h, p));
  w.host_name = ShmName("h", w);
  auto host = ShmCreate(w.host_name, kHostBytes);
  if (!host.has_value()) return host.error();
  // The memory stays if any peer is in another process (`remote_peers`,
  // set once the handle is published to one, `FiccoWindowExported`): that
  // process may still copy from it, and nothing
  // here relies on CUDA keeping a freed block for its importers.
  w.release.push_back([p, host = *host, device = w.device,
                       name = w.host_name](bool remote) {
    shm_unlink(name.c_str());  // Gone already unless never sealed.
    munmap(host, kHostBytes);
    if (remote) return;
    ScopedDevice scoped;
    if (!scoped.Set(device).failure()) cudaFree(p);
  });
  w.base = static_cast<char*>(p);
  w.host = reinterpret_cast<uint32_t*>(*host);
  handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  handle->append(w.host_name);
  return ffi::Error::Success();
}

ffi::Error CudaWindowMap(Window& w, int64_t peer, const std::string& handle) {
  cudaIpcMemHandle_t h;
  if (handle.size() <= sizeof(h)) {
    return ffi::Error::InvalidArgument(
        "rank " + std::to_string(peer) + "'s window handle has " +
        std::to_string(handle.size()) + " bytes, not a CUDA IPC handle's " +
        std::to_string(sizeof(h)) + " and a name");
  }
  std::memcpy(&h, handle.data(), sizeof(h));
  auto host = ShmOpen(handle.substr(sizeof(h)), kHostBytes);
  if (!host.has_value()) return host.error();
  w.peer_host[peer] = reinterpret_cast<uint32_t*>(*host);
  w.release.push_back([host = *host](bool) { munmap(host, kHostBytes); });
  ScopedDevice scoped;
  if (auto err = scoped.Set(w.device); err.failure()) return err;
  void* p = nullptr;
  FICCO_CUDA_RETURN_IF_ERROR(
      cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  w.release.push_back([p, device = w.device](bool) {
    ScopedDevice scoped;
    if (!scoped.Set(device).failure()) cudaIpcCloseMemHandle(p);
  });
  w.peers[peer] = static_cast<char*>(p);
  return ffi::Error::Success();
}

bool CudaSyncDevices(const std::vector<int32_t>& devices) {
  ScopedDevice scoped;
  for (int32_t d : devices) {
    if (scoped.Set(d).failure() || cudaDeviceSynchronize() != cudaSuccess) {
      return false;
    }
  }
  return true;
}

int64_t CudaWindowPending() {
  return WindowIndex<CudaBackend>::Get().Pending() +
         PushStates<CudaBackend>::Get().Pending();
}

void CudaWindowForget(int64_t family) {
  PushStates<CudaBackend>::Get().Forget(family);
}

}  // namespace ficco

// Not command-buffer compatible: the epochs advance on the host per call.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoWindowStartCuda, ficco::StartImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::RunId>()                         // execution
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .RemainingArgs()                                // sources
        .RemainingRets()                                // landings
        .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoWindowWaitCuda, ficco::WaitImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::RunId>()                         // execution
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .Arg<xla::ffi::AnyBuffer>()                     // landing
        .Ret<xla::ffi::AnyBuffer>()                     // aliased
        .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoWindowDoneCuda, ficco::DoneImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::RunId>()                         // execution
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .Arg<xla::ffi::AnyBuffer>()                     // out
        .RemainingArgs()                                // keepalive
        .Ret<xla::ffi::AnyBuffer>()                     // aliased
        .Attrs<ficco::Attrs>());

// The push protocol (push_protocol.h), on the same windows.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoPushArmCuda, ficco::PushArmImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::RunId>()                         // execution
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .Arg<xla::ffi::AnyBuffer>()                     // after
        .Ret<xla::ffi::AnyBuffer>()                     // flags
        .Ret<xla::ffi::AnyBuffer>()                     // rank
        .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoPushStartCuda, ficco::PushStartImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::RunId>()                         // execution
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .Arg<xla::ffi::AnyBuffer>()                     // parts
        .Arg<xla::ffi::AnyBuffer>()                     // flags
        .Ret<xla::ffi::AnyBuffer>()                     // flags, aliased
        .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoPushFinishCuda, ficco::PushFinishImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .Arg<xla::ffi::AnyBuffer>()                     // parts
        .Arg<xla::ffi::AnyBuffer>()                     // flags
        .Ret<xla::ffi::AnyBuffer>()                     // out
        .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FiccoPushGatherCuda, ficco::PushGatherImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // compute
        .Ctx<xla::ffi::RunId>()                         // execution
        .Ctx<xla::ffi::DeviceOrdinal>()                 // device
        .Arg<xla::ffi::AnyBuffer>()                     // x
        .Arg<xla::ffi::AnyBuffer>()                     // w
        .Ret<xla::ffi::AnyBuffer>()                     // out
        .Ret<xla::ffi::AnyBuffer>()                     // gathered
        .Attrs<ficco::Attrs>());
