// The late-landing test hook (tests/test_landed_kernel.py): lands `src` in
// `landing` piece by piece, piece i being rows [sum(rows[:i]), +rows[i]),
// and sets flags[i] to 1 once piece i has landed. On CUDA the pieces land on
// a side stream after a host-side delay of `timeout_ms`, so a kernel
// launched right after the call reads `landing` while it is still being
// written and must wait on the device for each piece's flag, as it does
// behind the window transport's landing flags (one GPU suffices, where that
// transport needs two). The CPU twin lands everything before it returns:
// an interpreted kernel cannot wait. `src` is returned aliased: the caller
// keeps it alive until the kernel that reads `landing` is done, then joins
// (the join hook: the compute stream waits for the device's last landing),
// so that no late copy or flag write outlives the buffers it touches.

#ifndef FICCO_XLA_FFI_LATE_LANDING_H_
#define FICCO_XLA_FFI_LATE_LANDING_H_

#include <cstdint>
#include <string>

#include "attrs.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

struct LateLanding {
  int64_t pieces = 0;
  int64_t row_bytes = 0;
};

// Checks the hook's buffers against its `rows` attribute.
inline ffi::ErrorOr<LateLanding> CheckLateLanding(const ffi::AnyBuffer& src,
                                                  const ffi::AnyBuffer& landing,
                                                  const ffi::AnyBuffer& flags,
                                                  const Attrs& attrs) {
  const auto dims = src.dimensions();
  int64_t total = 0;
  for (int64_t r : attrs.rows) total += r;
  if (dims.size() < 1 || dims[0] != total ||
      landing.size_bytes() != src.size_bytes() ||
      flags.element_type() != ffi::DataType::S32 ||
      flags.element_count() != attrs.rows.size()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "ficco late-landing hook: src must have sum(rows) = " +
        std::to_string(total) + " rows, landing its size, and flags " +
        std::to_string(attrs.rows.size()) + " int32 entries"));
  }
  LateLanding l;
  l.pieces = static_cast<int64_t>(attrs.rows.size());
  l.row_bytes = total == 0 ? 0 : static_cast<int64_t>(src.size_bytes()) / total;
  return l;
}

}  // namespace ficco

#endif  // FICCO_XLA_FFI_LATE_LANDING_H_
