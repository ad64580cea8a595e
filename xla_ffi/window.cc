// The window transport's C API (ficco_ffi.h): Python creates and maps the
// windows at lowering time and exchanges their handles between processes.

#include "window.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>

#include "epoch_runs.h"
#include "ficco_ffi.h"

namespace ficco {

void Windows::Retire(int platform, int64_t family, const std::string& why) {
  // The failure that poisoned a window (on any device) is what a later
  // call is told, on every device; `why` when none failed.
  std::string reason;
  ForFamily(platform, family, [&reason](Window& w) {
    if (reason.empty()) reason = w.Sticky();
  });
  if (reason.empty()) reason = why;
  PoisonFamily(platform, family, reason);
  std::lock_guard<std::mutex> lock(mu_);
  Retiree r;
  r.platform = platform;
  r.family = family;
  for (auto it = map_.lower_bound({platform, family, INT32_MIN});
       it != map_.end() && std::get<0>(it->first) == platform &&
       std::get<1>(it->first) == family;) {
    Window& w = *it->second;
    r.windows.push_back(it->second);
    r.devices.push_back(w.device);
    r.kept += platform != kFiccoCpu && w.remote_peers;
    // Only lowering (which holds the registry's callers apart) touches it.
    for (auto& f : w.release) {
      r.release.push_back(
          [f = std::move(f), remote = w.remote_peers] { f(remote); });
    }
    w.release.clear();
    it = map_.erase(it);
  }
  if (r.windows.empty()) return;
  retired_why_[{platform, family}] = reason;
  // Bounded: the oldest families (ids grow) are the least likely to run.
  if (retired_why_.size() > kRetiredKept) retired_why_.erase(retired_why_.begin());
  retired_.push_back(std::move(r));
}

int64_t Windows::Reap(int platform) {
  std::vector<Retiree> free;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = retired_.begin(); it != retired_.end();) {
      const bool held = std::any_of(
          it->windows.begin(), it->windows.end(),
          [](const std::weak_ptr<Window>& w) { return !w.expired(); });
      if (it->platform != platform || held) {
        ++it;
        continue;
      }
      kept_[platform] += it->kept;
      free.push_back(std::move(*it));
      it = retired_.erase(it);
    }
  }
  int64_t n = 0;
  for (Retiree& r : free) {
    // No start holds a window now, so none records an epoch again.
    EpochRuns::Get().Forget(platform, r.family);
    // No invocation holds the windows, but a device's queue may still run
    // what one enqueued (the watchdog ends every wait on them by its
    // deadline), and a device may read its peers' windows, so every device
    // of the family finishes before any of its memory goes; if one cannot
    // say so, the memory stays (counted as kept).
#ifdef FICCO_WITH_CUDA
    if (platform == kFiccoCuda && !CudaSyncDevices(r.devices)) {
      std::lock_guard<std::mutex> lock(mu_);
      kept_[platform] += static_cast<int64_t>(r.windows.size()) - r.kept;
      continue;
    }
#endif
    for (auto& f : r.release) f();
    n += static_cast<int64_t>(r.windows.size()) - r.kept;
  }
  return n;
}

std::string WindowWhere(const Plan& plan, const Window& w, uint32_t epoch) {
  std::ostringstream os;
  os << "ficco window copy of '" << plan.op_name << "' (site " << plan.site
     << ", epoch " << epoch << ") on device " << w.device << " (rank "
     << w.rank << " of " << w.size << ")";
  return os.str();
}

std::string ShmName(const char* kind, const Window& w) {
  static std::atomic<int64_t> counter{0};
  return "/ficco." + std::string(kind) + "." + std::to_string(getpid()) +
         "." + std::to_string(w.family) + "." + std::to_string(w.device) +
         "." + std::to_string(counter++);
}

ffi::ErrorOr<char*> ShmCreate(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    return ffi::Unexpected(ffi::Error::Internal(
        "shm_open(" + name + ") failed: " + std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const std::string why = std::strerror(errno);
    close(fd);
    shm_unlink(name.c_str());
    return ffi::Unexpected(
        ffi::Error::Internal("ftruncate of " + name + " failed: " + why));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return ffi::Unexpected(ffi::Error::Internal(
        "mmap of " + name + " failed: " + std::strerror(errno)));
  }
  return static_cast<char*>(p);  // ftruncate zero-fills.
}

ffi::ErrorOr<char*> ShmOpen(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    return ffi::Unexpected(ffi::Error::Internal(
        "shm_open(" + name + ") failed: " + std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "shared memory " + name + " is not " + std::to_string(bytes) +
        " bytes: the ranks lowered different programs"));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    return ffi::Unexpected(ffi::Error::Internal(
        "mmap of " + name + " failed: " + std::strerror(errno)));
  }
  return static_cast<char*>(p);
}

namespace {

int Report(const ffi::Error& err, char* error, int64_t error_len) {
  if (!err.failure()) return 0;
  if (error != nullptr && error_len > 0) {
    const std::string msg(err.message());
    const size_t n = std::min<size_t>(msg.size(), error_len - 1);
    std::memcpy(error, msg.data(), n);
    error[n] = '\0';
  }
  return 1;
}

ffi::Error Allocate(Window& w, std::string* handle) {
  if (w.platform == kFiccoCpu) return CpuWindowAllocate(w, handle);
#ifdef FICCO_WITH_CUDA
  if (w.platform == kFiccoCuda) return CudaWindowAllocate(w, handle);
#endif
  return ffi::Error::InvalidArgument("platform not compiled in");
}

}  // namespace
}  // namespace ficco

extern "C" {

int FiccoWindowCreate(int platform, int64_t family, int device, int64_t rank,
                      int64_t size, const int64_t* group_ids,
                      int64_t slot_bytes, char* handle,
                      int64_t* handle_len, char* error, int64_t error_len) {
  using ficco::ffi::Error;
  if (size < 1 || size > ficco::kMaxRanks || rank < 0 || rank >= size ||
      slot_bytes < 1) {
    return ficco::Report(Error::InvalidArgument(
                             "bad window geometry: rank " +
                             std::to_string(rank) + " of " +
                             std::to_string(size) + ", slot " +
                             std::to_string(slot_bytes) + " bytes"),
                         error, error_len);
  }
  if (ficco::Windows::Get().Find(platform, family, device)) {
    return ficco::Report(Error::InvalidArgument("window exists already"),
                         error, error_len);
  }
  auto w = std::make_shared<ficco::Window>();
  w->platform = platform;
  w->family = family;
  w->device = device;
  w->rank = rank;
  w->size = size;
  w->slot_bytes = slot_bytes;
  w->peers.assign(size, nullptr);
  w->peer_host.assign(size, nullptr);
  w->group_ids.assign(group_ids, group_ids + size);
  std::string h;
  if (int rc = ficco::Report(ficco::Allocate(*w, &h), error, error_len)) {
    return rc;
  }
  if (static_cast<int64_t>(h.size()) > *handle_len) {
    return ficco::Report(Error::Internal("handle buffer too small"), error,
                         error_len);
  }
  std::memcpy(handle, h.data(), h.size());
  *handle_len = static_cast<int64_t>(h.size());
  w->handle = h;
  w->peers[rank] = w->base;
  w->peer_host[rank] = w->host;
  ficco::Windows::Get().Add(std::move(w));
  return 0;
}

int FiccoWindowMap(int platform, int64_t family, int device, int64_t peer,
                   int peer_device, const char* handle, int64_t handle_len,
                   char* error, int64_t error_len) {
  using ficco::ffi::Error;
  auto w = ficco::Windows::Get().Find(platform, family, device);
  if (!w || peer < 0 || peer >= w->size) {
    return ficco::Report(Error::InvalidArgument("no such window or rank"),
                         error, error_len);
  }
  if (peer_device >= 0) {
    // Same process: the peer's window is already mapped here.
    auto other = ficco::Windows::Get().Find(platform, family, peer_device);
    if (!other) {
      return ficco::Report(
          Error::InvalidArgument("peer device " + std::to_string(peer_device) +
                                 " has no window of this family yet"),
          error, error_len);
    }
#ifdef FICCO_WITH_CUDA
    if (platform == kFiccoCuda) {
      if (int rc = ficco::Report(ficco::CudaEnablePeer(device, peer_device),
                                 error, error_len)) {
        return rc;
      }
    }
#endif
    w->peers[peer] = other->base;
    w->peer_host[peer] = other->host;
    return 0;
  }
  const std::string h(handle, handle_len);
  w->remote_peers = true;  // So rank `peer`'s process maps this one too.
  if (platform == kFiccoCpu) {
    return ficco::Report(ficco::CpuWindowMap(*w, peer, h), error, error_len);
  }
#ifdef FICCO_WITH_CUDA
  if (platform == kFiccoCuda) {
    return ficco::Report(ficco::CudaWindowMap(*w, peer, h), error, error_len);
  }
#endif
  return ficco::Report(Error::InvalidArgument("platform not compiled in"),
                       error, error_len);
}

void FiccoWindowExported(int platform, int64_t family, int device) {
  auto w = ficco::Windows::Get().Find(platform, family, device);
  // Its handle is published to another process, which may map it before
  // this one maps any of that process's windows (or fails to).
  if (w) w->remote_peers = true;
}

void FiccoWindowSealed(int platform, int64_t family, int device) {
  ficco::Windows::Get().CountFamily(platform, family);
  auto w = ficco::Windows::Get().Find(platform, family, device);
  // Every peer has mapped it: the names can go, the memory stays until the
  // last process that maps it exits (no leftovers in /dev/shm).
  if (w && !w->host_name.empty()) shm_unlink(w->host_name.c_str());
}

int64_t FiccoWindowEpoch(int platform, int64_t family, int device) {
  auto w = ficco::Windows::Get().Find(platform, family, device);
  return w ? static_cast<int64_t>(w->epoch.load()) : -1;
}

int FiccoWindowPoisoned(int platform, int64_t family, int device) {
  auto w = ficco::Windows::Get().Find(platform, family, device);
  return w ? static_cast<int>(w->Poisoned() || w->PeerPoisoned()) : -1;
}

int64_t FiccoWindowCount(int platform) {
  return ficco::Windows::Get().Count(platform);
}

void FiccoWindowForget(int platform, int64_t family) {
  if (platform == kFiccoCpu) ficco::CpuWindowForget(family);
#ifdef FICCO_WITH_CUDA
  if (platform == kFiccoCuda) ficco::CudaWindowForget(family);
#endif
}

void FiccoWindowRetire(int platform, int64_t family, const char* why) {
  FiccoWindowForget(platform, family);
  ficco::Windows::Get().Retire(platform, family, why);
}

int64_t FiccoWindowReap(int platform) {
  return ficco::Windows::Get().Reap(platform);
}

int64_t FiccoWindowIssueWaits(int platform) {
  return ficco::Windows::Get().IssueWaits(platform);
}

int64_t FiccoWindowPending(int platform) {
  if (platform == kFiccoCpu) return ficco::CpuWindowPending();
#ifdef FICCO_WITH_CUDA
  if (platform == kFiccoCuda) return ficco::CudaWindowPending();
#endif
  return -1;
}

}  // extern "C"
