// Which execution each epoch of a window family runs in, among the devices
// of this process (docs/windows.md, "Threading assumptions").
//
// The window and push transports pair the ranks' invocations by epoch: the
// e-th start on a window is the same invocation on every device, as long as
// every device runs the programs that share the window in one order. When
// several host threads dispatch them, XLA may run them in different orders
// on different devices, and epoch e of one device would pair with another
// program's epoch e elsewhere: the push transport's pooled windows would
// add one program's partials to another's result. Within one process the
// devices of one execution share its run id, so each start records its
// epoch's run id here, and one whose peer ran that epoch in another
// execution fails, poisoning the window, instead of mixing data. Devices in
// other processes have run ids of their own and are not compared.

#ifndef FICCO_XLA_FFI_EPOCH_RUNS_H_
#define FICCO_XLA_FFI_EPOCH_RUNS_H_

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "dispatch_advice.h"
#include "window.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

class EpochRuns {
 public:
  static EpochRuns& Get() {
    static EpochRuns* e = new EpochRuns();  // Leaked: handlers may run at exit.
    return *e;
  }

  // Records that a device of this process runs epoch `epoch` of `family`
  // in execution `run_id`; if another device of this process ran that epoch
  // in another execution, returns that execution instead.
  std::optional<int64_t> Record(int platform, int64_t family, uint32_t epoch,
                                int64_t run_id) {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& s = families_[{platform, family}][epoch % kEpochsKept];
    if (s.used && s.epoch == epoch) {
      if (s.run_id != run_id) return s.run_id;
      return std::nullopt;
    }
    s = Slot{true, epoch, run_id};
    return std::nullopt;
  }

 private:
  // The ranks of a window are at most two epochs apart (a push waits for
  // its receivers to have read epoch e - 2), so a few slots suffice.
  static constexpr uint32_t kEpochsKept = 8;
  struct Slot {
    bool used = false;
    uint32_t epoch = 0;
    int64_t run_id = 0;
  };
  std::mutex mu_;
  std::map<std::pair<int, int64_t>, std::array<Slot, kEpochsKept>> families_;
};

// A start's check, right after it took epoch `epoch` of `win` in execution
// `run_id`: success, or the window poisoned and the error (`where` names the
// start).
inline ffi::Error CheckEpochRun(int platform, Window& win, uint32_t epoch,
                                int64_t run_id, const std::string& where) {
  const auto other =
      EpochRuns::Get().Record(platform, win.family, epoch, run_id);
  if (!other.has_value()) return ffi::Error::Success();
  const std::string why =
      where + ": epoch " + std::to_string(epoch) + " of this window runs in" +
      " execution " + std::to_string(run_id) + " on this device but in" +
      " execution " + std::to_string(*other) + " on another device of this" +
      " process: two programs (or two calls of one) that share the window" +
      " ran in different orders on different devices, and pairing them" +
      " would mix their data; " + kIfSeveralDispatchers;
  win.Poison(why);
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, why);
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_EPOCH_RUNS_H_
