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
//
// Within one execution, one traced site can run twice (start_instance.h):
// on XLA:CPU, where the start instruction is known, each epoch also records
// which instruction ran it, and a peer that ran the other one there fails
// the same way.

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

  // What another device of this process ran at an epoch, when it differs.
  struct Conflict {
    int64_t run_id;
    bool other_instance;  // same execution, another start instruction
  };
  // Records that a device of this process runs epoch `epoch` of `family`
  // in execution `run_id`, by start instruction `instance` (0: unknown);
  // if another device of this process ran that epoch in another execution,
  // or by another instruction, returns what it ran instead.
  std::optional<Conflict> Record(int platform, int64_t family, uint32_t epoch,
                                 int64_t run_id, int64_t instance) {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& s = families_[{platform, family}][epoch % kEpochsKept];
    if (s.used && s.epoch == epoch) {
      if (s.run_id != run_id) return Conflict{s.run_id, false};
      if (s.instance != 0 && instance != 0 && s.instance != instance) {
        return Conflict{s.run_id, true};
      }
      return std::nullopt;
    }
    s = Slot{true, epoch, run_id, instance};
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
    int64_t instance = 0;
  };
  std::mutex mu_;
  std::map<std::pair<int, int64_t>, std::array<Slot, kEpochsKept>> families_;
};

// A start's check, right after it took epoch `epoch` of `win` in execution
// `run_id` by start instruction `instance` (start_instance.h; 0 unknown):
// success, or the window poisoned and the error (`where` names the start).
inline ffi::Error CheckEpochRun(int platform, Window& win, uint32_t epoch,
                                int64_t run_id, const std::string& where,
                                int64_t instance) {
  const auto other =
      EpochRuns::Get().Record(platform, win.family, epoch, run_id, instance);
  if (!other.has_value()) return ffi::Error::Success();
  const std::string why =
      other->other_instance
          ? where + ": epoch " + std::to_string(epoch) + " of this window" +
                " runs one call of this site on this device and another" +
                " call of it on another device of this process: the site" +
                " runs twice in this execution (a jitted function holding" +
                " the op called twice, or jax.checkpoint's recomputation)," +
                " XLA:CPU ran the two calls in different orders on different" +
                " devices, and pairing them would mix their data; order the" +
                " calls by data (feed one's result into the other), trace" +
                " each call on its own (call the op outside the jitted" +
                " function), or use transport='rendezvous', which pairs the" +
                " calls by instruction"
          : where + ": epoch " + std::to_string(epoch) + " of this window" +
                " runs in execution " + std::to_string(run_id) + " on this" +
                " device but in execution " + std::to_string(other->run_id) +
                " on another device of this process: two programs (or two" +
                " calls of one) that share the window ran in different" +
                " orders on different devices, and pairing them would mix" +
                " their data; " + kIfSeveralDispatchers;
  // Every device of the family here: their copies of this epoch wait for
  // flags that now will never come, and fail at once on seeing it (the CPU
  // twin's waits look), with this message rather than a timeout's.
  Windows::Get().PoisonFamily(platform, win.family, why);
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, why);
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_EPOCH_RUNS_H_
