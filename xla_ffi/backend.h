// The backend concept: what every protocol (peer_copy_protocol.h for the
// rendezvous transport, window_protocol.h, push_protocol.h and
// gather_push_protocol.h for the window and push transports) asks of a
// platform. Each platform implements it once: CpuBackend (cpu_backend.h, the
// CPU twin: worker threads and memcpy) and CudaBackend (cuda_backend.h:
// streams, copy engines, stream memory operations). The protocols are
// written once over it, so the CPU twin runs every protocol step the GPU
// runs.
//
// A backend instance is made per handler call (it holds the compute
// stream). Every operation returns ffi::Error and only enqueues: nothing
// blocks the calling thread on a peer.
//
// Types and constants
//   Event                      an event of the platform (Event*: a handle)
//   kPlatform                  kFiccoCpu or kFiccoCuda (ficco_ffi.h)
//   kFlagsMustAlias            the kernel's flags must be the buffer the
//                              copies read (not a copy XLA made)
//   kHostOrdered               flag waits must be enqueued after the
//                              writes they wait for (GPU hardware queues)
//   kStageBeforeCompute        the window stage runs before the compute
//                              stream goes on (it shares the SMs)
//   kComputeQueue              the queue index that means the compute stream
//   kNamesWaits                a timeout can name who never signalled
//   SupportsIssueMode(mode), DefaultIssueMode(), BindIssuer(device)
//                              the rendezvous issue modes (issuer.h)
//
// Events and the compute stream
//   AcquireEvent(device), ReleaseEvent(device, event)     per-device pool
//   RecordOnCompute(device, event)     event <- compute stream now
//   WaitOnCompute(device, event)       compute stream waits for event
//   DrainWait(event, deadline)         compute waits, bounded (failed runs)
//   ZeroOnCompute(data, bytes), SetInt32OnCompute(data, value)
//   EnsurePeerAccess(device, peer_device)   once per pair
//
// Queues (a queue is a copy-engine stream of `device`, by index; `inv` is
// the invocation the operation belongs to: a failed one skips its work)
//   WaitEvent(inv, device, queue, event)            queue waits for event
//   Copy(inv, device, queue, dst, src, bytes)       on the copy engine
//   Record(inv, device, queue, event)               event <- queue now
//   WaitFlag(inv, device, queue, addr, value, who)  queue waits *addr >= value
//   WriteFlag(inv, device, queue, addr, value)      *addr = value after the
//                                                   queue's earlier work
//   FlagOps(inv, device, queue, ops)                a batch of the two
//   FlagReady(device, index, flag, target, after, out, timeout_ms)
//                                      out <- *flag >= target (a kernel's
//                                      completion flag; rendezvous)
//   Sum(inv, device, queue, ...), Gemm(inv, device, queue, gemm)
//                                      the push ops' compute on a queue
//
// The queue operations take the invocation of either transport: the
// rendezvous transport's (Invocation, peer_copy_registry.h), whose queues
// block on an event like a stream and may be driven for any device (the
// last rank to arrive issues for all), and the window transport's
// (WindowInvocation, window_protocol.h), whose queues are per window and
// whose waits yield. A platform implements each for both; the meaning of
// the operation is the same.

#ifndef FICCO_XLA_FFI_BACKEND_H_
#define FICCO_XLA_FFI_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

struct FlagOp;  // push_protocol.h

// The window transport's queue indexes besides its pull queues
// 0 .. num_streams - 1: the stage and the signal queue; and the push queue
// (one per device: pieces leave in kernel order, and they share the
// receivers' inbound links anyway).
inline constexpr int64_t kStageQueue = 1 << 20;
inline constexpr int64_t kSignalQueue = kStageQueue + 1;
inline constexpr int64_t kPushQueue = kStageQueue + 2;

// The invocations a backend's queue operations belong to.
template <class B>
struct Invocation;
template <class B>
struct WindowInvocation;

}  // namespace ficco

// The queue operations' signatures, spelled once: a backend declares them
// for each invocation type (`Event` is its own) and defines them in its
// transports' files.
#define FICCO_BACKEND_QUEUE_OPS(INV)                                         \
  ::xla::ffi::Error WaitEvent(const std::shared_ptr<INV>& inv,               \
                              int32_t device, int64_t queue, Event* e);      \
  ::xla::ffi::Error Copy(const std::shared_ptr<INV>& inv, int32_t device,    \
                         int64_t queue, char* dst, const char* src,          \
                         size_t bytes);                                      \
  ::xla::ffi::Error Record(const std::shared_ptr<INV>& inv, int32_t device,  \
                           int64_t queue, Event* e);

// The flag and compute operations of the window and push transports.
#define FICCO_BACKEND_WINDOW_OPS(INV)                                        \
  ::xla::ffi::Error WaitFlag(const std::shared_ptr<INV>& inv,                \
                             int32_t device, int64_t queue, uint32_t* addr,  \
                             uint32_t value, const std::string& who);        \
  ::xla::ffi::Error WriteFlag(const std::shared_ptr<INV>& inv,               \
                              int32_t device, int64_t queue, uint32_t* addr, \
                              uint32_t value);                               \
  ::xla::ffi::Error FlagOps(const std::shared_ptr<INV>& inv, int32_t device, \
                            int64_t queue,                                   \
                            const std::vector<::ficco::FlagOp>& ops);        \
  ::xla::ffi::Error Sum(const std::shared_ptr<INV>& inv, int32_t device,     \
                        int64_t queue, ::xla::ffi::DataType dtype,           \
                        char* out, const char* own, const char* landing,     \
                        int64_t chunks, int64_t peers, int64_t chunk_elems); \
  ::xla::ffi::Error Gemm(const std::shared_ptr<INV>& inv, int32_t device,    \
                         int64_t queue, const ::ficco::GemmArgs& g);

// The rendezvous transport's flag wait (a kernel's completion flag).
#define FICCO_BACKEND_FLAG_READY                                             \
  ::xla::ffi::Error FlagReady(int32_t device, int64_t flag_index,            \
                              const int32_t* flag, int64_t target,           \
                              Event* after, Event* out, int64_t timeout_ms);

#endif  // FICCO_XLA_FFI_BACKEND_H_
