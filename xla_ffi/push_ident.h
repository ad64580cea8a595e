// Which op each rank runs at an epoch of a push window, checked before a
// rank consumes what its peers pushed.
//
// The push transport's windows are pooled: the k-th push site of every
// program shares the k-th family (windows.pooled_family), and ranks pair
// their calls by epoch. That holds when one thread dispatches the programs
// that share the devices. From several threads XLA may run two programs in
// different orders on different ranks, and pairing epoch e of one with
// epoch e of the other would add one program's partials into the other's
// result, or multiply its shards there. Within a process `epoch_runs.h`
// catches it; across processes nothing else can, so every rank publishes,
// per epoch, the identity of the op it runs there (a hash of the program,
// the op and the landing half's size, equal on every rank of one call),
// and each rank compares its peers' with its own before it consumes their
// pieces: a mismatch fails the call and poisons the window, naming the
// cause, instead of mixing. (Two runs of one program, dispatched from two
// threads, have one identity, and so do two programs of one name running
// one op of one size: those mixes stay undetected across processes.)
//
// The identity lives in the host words (window.h), a ring of kIdentKept
// epochs. Publishing comes after the start's waits for every receiver to
// have freed epoch e - 2, and checking before this rank frees epoch e, so
// a peer is at most one epoch ahead of a check and the ring entry is the
// checked epoch's. CUDA orders these on the host: it publishes after the
// start's host waits and checks after the finish's (kHostOrdered). The
// CPU twin's host does not order its peers, so it does both in the lanes:
// after the freed waits, and before the waits for the peers' pieces.

#ifndef FICCO_XLA_FFI_PUSH_IDENT_H_
#define FICCO_XLA_FFI_PUSH_IDENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "attrs.h"
#include "dispatch_advice.h"
#include "window.h"
#include "window_protocol.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

// The identity of the op a push handler runs: FNV-1a over its program,
// op and landing half size; never 0 (the words' initial value).
inline uint32_t PushIdent(const Attrs& a) {
  uint32_t h = 2166136261u;
  auto mix = [&h](std::string_view s) {
    for (unsigned char c : s) h = (h ^ c) * 16777619u;
    h = (h ^ 0xffu) * 16777619u;  // separator
  };
  mix(a.program);
  mix(a.op_name);
  mix(std::to_string(a.half_bytes));
  return h == 0 ? 1 : h;
}

// Publishes this rank's identity for epoch `e` in its host words.
inline void PublishIdent(const Window& w, uint32_t e, uint32_t ident) {
  uint32_t* slot = w.host + kIdentBase + 2 * (e % kIdentKept);
  __atomic_store_n(slot, ident, __ATOMIC_RELAXED);
  __atomic_store_n(slot + 1, e, __ATOMIC_RELEASE);
}

// "" if rank `q` published `ident` for epoch `e`, else why not (for the
// error of the call at `where`).
inline std::string IdentMismatch(const Window& w, int64_t q, uint32_t e,
                                 uint32_t ident, const std::string& where) {
  const uint32_t* slot = w.peer_host[q] + kIdentBase + 2 * (e % kIdentKept);
  const uint32_t at = __atomic_load_n(slot + 1, __ATOMIC_ACQUIRE);
  const uint32_t theirs = __atomic_load_n(slot, __ATOMIC_RELAXED);
  if (at == e && theirs == ident) return "";
  if (at != e) {
    // The callers check only once the peer has published epoch e, and it
    // cannot be kIdentKept epochs further on: a broken invariant, not a
    // dispatch order.
    return where + ": internal error (please report): " + RankName(w, q) +
           "'s identity slot holds epoch " + std::to_string(at) +
           " where this op checks epoch " + std::to_string(e) +
           kAfterWindowTimeout;
  }
  return where + ": " + RankName(w, q) +
         " ran another op at this epoch of the shared window (identity " +
         std::to_string(theirs) + ", this op's " + std::to_string(ident) +
         "): programs that share the window ran in different orders on"
         " different ranks, and pairing them would mix their data; " +
         kIfSeveralDispatchers + kAfterWindowTimeout;
}

// After the start's freed waits on `queue`: publishes `ident` for `inv`'s
// epoch (on the host for host-ordered backends, else in the lane).
template <class B>
ffi::Error PublishIdentAfterFreed(B& backend,
                                  const std::shared_ptr<WindowInvocation<B>>& inv,
                                  int32_t device, int64_t queue,
                                  uint32_t ident) {
  if constexpr (B::kHostOrdered) {
    PublishIdent(*inv->win, inv->epoch, ident);
    return ffi::Error::Success();
  } else {
    // Even once failed: which op this rank runs at the epoch stays true,
    // and a peer that checks it fails at once, naming a mismatch.
    return backend.InLane(inv, device, queue, [inv, ident] {
      PublishIdent(*inv->win, inv->epoch, ident);
    });
  }
}

// Host-ordered backends, once rank `q`'s staged_enqueued reached the epoch:
// success, or the window poisoned and the error.
template <class B>
ffi::Error CheckIdentOnHost(const WindowInvocation<B>& inv, int64_t q,
                            uint32_t ident) {
  const std::string why =
      IdentMismatch(*inv.win, q, inv.epoch, ident, inv.where);
  if (why.empty()) return ffi::Error::Success();
  Windows::Get().PoisonFamily(B::kPlatform, inv.win->family, why);
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, why);
}

// The CPU twin, on `queue` before it waits for its peers' pieces: waits
// until every peer has published its identity for the epoch, or one has
// published another, which fails the invocation (its later operations
// skip) and poisons the family at once. Before the pieces, and all peers
// at once: a rank that failed on seeing a mismatch first pushes no pieces,
// and a rank whose window that poisoned takes no epoch, but the others
// have published theirs.
template <class B>
ffi::Error CheckIdentsInLane(B& backend,
                             const std::shared_ptr<WindowInvocation<B>>& inv,
                             int32_t device, int64_t queue, uint32_t ident) {
  const uint32_t e = inv->epoch;
  return backend.WaitUntil(
      inv, device, queue,
      [inv, e, ident] {
        const Window& w = *inv->win;
        bool all = true;
        for (int64_t q = 0; q < w.size; ++q) {
          if (q == w.rank) continue;
          const uint32_t* at =
              w.peer_host[q] + kIdentBase + 2 * (e % kIdentKept) + 1;
          if (__atomic_load_n(at, __ATOMIC_ACQUIRE) != e) {
            all = false;
            continue;
          }
          const std::string why = IdentMismatch(w, q, e, ident, inv->where);
          if (!why.empty()) {
            Windows::Get().PoisonFamily(w.platform, w.family, why);
            inv->Fail(why);
            return true;
          }
        }
        return all;
      },
      "every peer to start epoch " + std::to_string(e));
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_PUSH_IDENT_H_
