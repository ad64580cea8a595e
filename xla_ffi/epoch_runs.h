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
  // or by another instruction, returns what it ran instead. `local` is the
  // number of devices of the family in this process: once each has
  // recorded an epoch, it is dropped. An epoch is kept until then however
  // far the other devices have run ahead (XLA:CPU may run one device's
  // starts of independent calls well before another's), so no epoch goes
  // unchecked; only a failed execution, whose devices never all record its
  // epochs (the family is poisoned then), leaves some, at most kMaxKept.
  std::optional<Conflict> Record(int platform, int64_t family, uint32_t epoch,
                                 int64_t run_id, int64_t instance,
                                 int64_t local) {
    std::lock_guard<std::mutex> lock(mu_);
    std::map<uint32_t, Slot>& epochs = families_[{platform, family}];
    auto [it, added] = epochs.try_emplace(epoch, Slot{run_id, instance, 0});
    Slot& s = it->second;
    std::optional<Conflict> conflict;
    if (!added && s.run_id != run_id) {
      conflict = Conflict{s.run_id, false};
    } else if (!added && s.instance != 0 && instance != 0 &&
               s.instance != instance) {
      conflict = Conflict{s.run_id, true};
    }
    if (++s.recorded >= local) {
      epochs.erase(it);
    } else if (static_cast<int64_t>(epochs.size()) > kMaxKept) {
      epochs.erase(epochs.begin());
    }
    return conflict;
  }

  // Drops a retired family's epochs.
  void Forget(int platform, int64_t family) {
    std::lock_guard<std::mutex> lock(mu_);
    families_.erase({platform, family});
  }

 private:
  // Epochs a family keeps that not every local device has recorded: far
  // more than any run of calls XLA puts in flight at once.
  static constexpr int64_t kMaxKept = 4096;
  struct Slot {
    int64_t run_id = 0;
    int64_t instance = 0;
    int64_t recorded = 0;  // local devices that recorded this epoch
  };
  std::mutex mu_;
  std::map<std::pair<int, int64_t>, std::map<uint32_t, Slot>> families_;
};

// A start's check, right after it took epoch `epoch` of `win` in execution
// `run_id` by start instruction `instance` (start_instance.h; 0 unknown):
// success, or the window poisoned and the error (`where` names the start).
inline ffi::Error CheckEpochRun(int platform, Window& win, uint32_t epoch,
                                int64_t run_id, const std::string& where,
                                int64_t instance) {
  const auto other = EpochRuns::Get().Record(platform, win.family, epoch,
                                             run_id, instance, win.local);
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
