// Symmetric windows: the state of the window transport (docs/windows.md),
// shared by its CPU twin and its CUDA handlers.
//
// A window is memory a device owns and every rank of its group has mapped
// (peer access, CUDA IPC, or POSIX shared memory on the CPU twin): a header
// of 32-bit flags and a slot that holds the sources of one invocation. Each
// start of a program has windows of its own (its later traces reuse them),
// created and mapped once, from Python at lowering time (the handles travel
// through JAX's distributed key-value store), so a call needs no host
// rendezvous: ranks synchronise through the flags alone. Per start, because
// devices need not run independent call sites in the same order (XLA:CPU
// does not), while the n-th run of one site is the same invocation on every
// device.

#ifndef FICCO_XLA_FFI_WINDOW_H_
#define FICCO_XLA_FFI_WINDOW_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "peer_copy_plan.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

// Header layout, in 32-bit words. ready[q]: the last epoch rank q staged
// (q writes it into every peer's window). freed[q]: the last epoch rank q
// finished reading from this window (q writes it here).
inline constexpr int64_t kMaxRanks = 512;
inline constexpr int64_t kHeaderBytes = 2 * kMaxRanks * 4;
// Host words of a rank (host memory every process of the host maps):
// [kStagedEnqueued] the last epoch whose stage and ready writes this rank
// has enqueued; [kAllEnqueued] the last epoch whose every operation it has
// enqueued. See docs/windows.md, "Why the host orders the waits".
// [kIdentBase + 2 (e % kIdentKept)] and the word after it: the identity of
// the op this rank ran at epoch e of a push window, and e (push_ident.h).
// [kPoisonedWord]: 1 once this rank's window is poisoned, with its failure
// (NUL-terminated) from byte kPoisonText: every rank reads its peers', so a
// failure in one process poisons the family in the others too (they would
// otherwise reuse it after lowering again while this one makes a new one).
inline constexpr int64_t kStagedEnqueued = 0, kAllEnqueued = 1;
inline constexpr int64_t kIdentBase = 2, kIdentKept = 4;
inline constexpr int64_t kPoisonedWord = kIdentBase + 2 * kIdentKept;
inline constexpr int64_t kPoisonText = 64, kPoisonTextBytes = 1024;
inline constexpr int64_t kHostBytes = 4096;
static_assert(4 * (kPoisonedWord + 1) <= kPoisonText &&
              kPoisonText + kPoisonTextBytes <= kHostBytes);
// One slot: the next run of a site stages once every peer has read the
// previous one (consecutive runs of a site are ordered by the program
// anyway), and memory stays at one copy of the site's sources.
inline constexpr int64_t kSlots = 1;
inline constexpr int64_t kSlotAlign = 256;

struct Window {
  int platform = 0;
  int64_t family = 0;
  int32_t device = 0;  // local ordinal (the handler's DeviceOrdinal)
  int64_t rank = 0, size = 0;
  int64_t local = 1;  // windows of the family in this process (sealing sets)
  int64_t slot_bytes = 0;
  char* base = nullptr;      // this device's window
  std::string handle;        // what peers in other processes map
  std::vector<char*> peers;  // peers[q]: rank q's window, mapped here
  std::vector<int64_t> group_ids;  // global device id of each rank
  uint32_t* host = nullptr;               // this rank's host words
  std::vector<uint32_t*> peer_host;       // peer_host[q]: rank q's
  std::string host_name;                  // its shared-memory name
  // Epochs count the starts on this window; every rank of the group runs
  // the same starts in the same order (one SPMD program), so the e-th start
  // is the same invocation everywhere.
  std::atomic<uint32_t> epoch{0};
  // Held by a handler of this window from its checks before it takes an
  // epoch until it has enqueued its last operation (IssueLock): XLA runs a
  // program over one device on the thread that dispatched it, so with two
  // dispatching threads two programs' handlers run on one device at once,
  // and a queue must still get each window's epochs in order, or a peer
  // waiting for epoch e would take epoch e + 1's flag for it and read a
  // half not yet landed (docs/protocol.md, "Several dispatching threads").
  std::timed_mutex issue;
  mutable std::mutex mu;
  std::string sticky_error;  // a failed invocation poisons the window
  std::atomic<bool> poisoned{false};  // sticky_error is set
  // What frees this window's memory and unmaps the peers' windows it mapped
  // from other processes (the platform's allocate and map add to it); run
  // by Windows::Reap once the family is retired and nothing holds it, told
  // whether `remote_peers` (the window is gone by then).
  std::vector<std::function<void(bool remote_peers)>> release;
  bool remote_peers = false;  // some rank's window is in another process

  uint32_t* ReadyOf(char* window, int64_t q) const {
    return reinterpret_cast<uint32_t*>(window) + q;
  }
  uint32_t* FreedOf(char* window, int64_t q) const {
    return reinterpret_cast<uint32_t*>(window) + kMaxRanks + q;
  }
  char* Slot(char* window, uint32_t epoch) const {
    // The CPU twin keeps the host words between header and slot; CUDA
    // windows leave the same gap unused, so both lay slots out alike.
    return window + kHeaderBytes + kHostBytes + (epoch % kSlots) * slot_bytes;
  }
  std::string Sticky() const {
    std::lock_guard<std::mutex> lock(mu);
    return sticky_error;
  }
  // Lock-free: the CPU twin's flag waits poll it (cpu_window.cc).
  bool Poisoned() const { return poisoned.load(std::memory_order_acquire); }
  void Poison(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu);
    if (sticky_error.empty()) {
      sticky_error = why;
      if (host != nullptr) {  // For the peers (kPoisonedWord).
        char* text = reinterpret_cast<char*>(host) + kPoisonText;
        const size_t n =
            std::min<size_t>(why.size(), kPoisonTextBytes - 1);
        std::memcpy(text, why.data(), n);
        text[n] = '\0';
        __atomic_store_n(host + kPoisonedWord, 1u, __ATOMIC_RELEASE);
      }
    }
    poisoned.store(true, std::memory_order_release);
  }
  // Whether a peer's window of this family is poisoned (in this process or
  // another); if so, poisons this one too, naming the peer and its failure.
  bool PeerPoisoned() {
    for (int64_t q = 0; q < size; ++q) {
      const uint32_t* words = q == rank ? nullptr : peer_host[q];
      if (words == nullptr ||
          __atomic_load_n(words + kPoisonedWord, __ATOMIC_ACQUIRE) == 0) {
        continue;
      }
      const char* text = reinterpret_cast<const char*>(words) + kPoisonText;
      Poison("rank " + std::to_string(q) + " (device " +
             std::to_string(group_ids[q]) + ") failed on this window: " +
             std::string(text, strnlen(text, kPoisonTextBytes)));
      return true;
    }
    return false;
  }
};

// Windows by (platform, family, device); created through the C API.
class Windows {
 public:
  static Windows& Get() {
    static Windows* w = new Windows();  // Leaked: handlers may run at exit.
    return *w;
  }
  std::shared_ptr<Window> Find(int platform, int64_t family, int32_t device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find({platform, family, device});
    return it == map_.end() ? nullptr : it->second;
  }
  // Poisons the windows of `family` on every device of this process.
  void PoisonFamily(int platform, int64_t family, const std::string& why) {
    ForFamily(platform, family, [&why](Window& w) { w.Poison(why); });
  }
  // Takes `family` out of use in this process: poisons its windows with
  // `why`, so a call still in flight on them fails at once, and removes
  // them, so a later call that names the family finds `why` (Retired). Their
  // memory goes at a later Reap, once no invocation holds any of them.
  void Retire(int platform, int64_t family, const std::string& why);
  // Frees the memory of the retired families that nothing holds any more
  // (their invocations have ended, and on CUDA their devices' queued work
  // with them). Returns how many windows it freed.
  int64_t Reap(int platform);
  // Why `family` was retired, or "" if it was not.
  std::string Retired(int platform, int64_t family) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = retired_why_.find({platform, family});
    return it == retired_why_.end() ? std::string() : it->second;
  }
  // What a call naming `family` is told it failed on: `win`'s sticky
  // error, or why the family was retired when `win` is gone (null); "" if
  // neither.
  std::string Failure(int platform, int64_t family, const Window* win) {
    return win != nullptr ? win->Sticky() : Retired(platform, family);
  }
  // Once every window of `family` in this process exists (sealing): each
  // learns how many there are (`Window::local`).
  void CountFamily(int platform, int64_t family) {
    int64_t n = 0;
    ForFamily(platform, family, [&n](Window&) { ++n; });
    ForFamily(platform, family, [n](Window& w) { w.local = n; });
  }
  void Add(std::shared_ptr<Window> w) {
    std::lock_guard<std::mutex> lock(mu_);
    map_[{w->platform, w->family, w->device}] = std::move(w);
  }
  // A handler found another thread's handler holding its window's issue
  // lock (IssueLock), and how often so far, per platform.
  void CountIssueWait(int platform) {
    std::lock_guard<std::mutex> lock(mu_);
    ++issue_waits_[platform];
  }
  int64_t IssueWaits(int platform) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = issue_waits_.find(platform);
    return it == issue_waits_.end() ? 0 : it->second;
  }
  // Windows whose memory is held: in use, or retired and not yet reaped.
  int64_t Count(int platform) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (const auto& [key, w] : map_) n += std::get<0>(key) == platform;
    for (const Retiree& r : retired_) {
      if (r.platform == platform) n += static_cast<int64_t>(r.windows.size());
    }
    auto kept = kept_.find(platform);
    return n + (kept == kept_.end() ? 0 : kept->second);
  }

 private:
  template <class F>
  void ForFamily(int platform, int64_t family, F f) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = map_.lower_bound({platform, family, INT32_MIN});
         it != map_.end() && std::get<0>(it->first) == platform &&
         std::get<1>(it->first) == family;
         ++it) {
      f(*it->second);
    }
  }

  // A retired family's windows in this process, until Reap frees them.
  struct Retiree {
    int platform = 0;
    int64_t family = 0;
    std::vector<std::weak_ptr<Window>> windows;
    std::vector<int32_t> devices;
    std::vector<std::function<void()>> release;
    int64_t kept = 0;  // CUDA windows a process of another rank maps
  };

  std::mutex mu_;
  std::map<std::tuple<int, int64_t, int32_t>, std::shared_ptr<Window>> map_;
  std::vector<Retiree> retired_;
  // Why each retired family was (a line per failure, kept for the error of
  // a program compiled against it that runs again), for the last
  // kRetiredKept families.
  static constexpr size_t kRetiredKept = 1024;
  std::map<std::pair<int, int64_t>, std::string> retired_why_;
  // Per platform: reaped windows whose device memory stays (Retiree::kept).
  std::map<int, int64_t> kept_;
  std::map<int, int64_t> issue_waits_;
};

// `w.issue`, locked, unless another thread's handler holds it for more
// than `timeout_ms` (the lock does not own it then: CheckIssueLock). A wait
// is counted (FiccoWindowIssueWaits): it usually means programs that share
// the window are being dispatched from several threads.
inline std::unique_lock<std::timed_mutex> IssueLock(Window& w,
                                                    int64_t timeout_ms) {
  std::unique_lock<std::timed_mutex> lock(w.issue, std::try_to_lock);
  if (!lock.owns_lock()) {
    Windows::Get().CountIssueWait(w.platform);
    (void)lock.try_lock_for(std::chrono::milliseconds(timeout_ms));
  }
  return lock;
}

// "ficco window copy of 'op' (site 3, epoch 7) on device 2 (rank 2 of 4)".
std::string WindowWhere(const Plan& plan, const Window& w, uint32_t epoch);

// POSIX shared memory of this host: created zeroed, or opened by name.
ffi::ErrorOr<char*> ShmCreate(const std::string& name, size_t bytes);
ffi::ErrorOr<char*> ShmOpen(const std::string& name, size_t bytes);
std::string ShmName(const char* kind, const Window& w);

// Platform halves of the C API (cpu_window.cc, cuda_window.cu): allocate the
// window memory and export a handle; map a peer's window from its handle.
ffi::Error CpuWindowAllocate(Window& w, std::string* handle);
ffi::Error CpuWindowMap(Window& w, int64_t peer, const std::string& handle);
int64_t CpuWindowPending();
void CpuWindowForget(int64_t family);
#ifdef FICCO_WITH_CUDA
ffi::Error CudaWindowAllocate(Window& w, std::string* handle);
ffi::Error CudaWindowMap(Window& w, int64_t peer, const std::string& handle);
ffi::Error CudaEnablePeer(int32_t device, int32_t peer_device);
// Waits for every device's queued work (before a retired family is freed);
// false if a device could not be synchronized.
bool CudaSyncDevices(const std::vector<int32_t>& devices);
int64_t CudaWindowPending();
void CudaWindowForget(int64_t family);
#endif

}  // namespace ficco

#endif  // FICCO_XLA_FFI_WINDOW_H_
