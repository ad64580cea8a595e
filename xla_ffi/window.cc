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

#include "ficco_ffi.h"

namespace ficco {

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
  return w ? static_cast<int>(w->Poisoned()) : -1;
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

int64_t FiccoWindowPending(int platform) {
  if (platform == kFiccoCpu) return ficco::CpuWindowPending();
#ifdef FICCO_WITH_CUDA
  if (platform == kFiccoCuda) return ficco::CudaWindowPending();
#endif
  return -1;
}

}  // extern "C"
