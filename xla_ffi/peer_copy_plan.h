// The transfer plan a peer-copy start receives, decoded from its attributes.
//
// Platform independent: the CPU twin and the CUDA handlers decode and check
// the same attributes (see docs/protocol.md, "Attributes").

#ifndef FICCO_XLA_FFI_PEER_COPY_PLAN_H_
#define FICCO_XLA_FFI_PEER_COPY_PLAN_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attrs.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

namespace ffi = ::xla::ffi;

struct Transfer {
  int64_t dst, dst_row, src_offset, src, src_row, rows, stream;
  // >= 0: the source rows are complete once the source rank's flag
  // `src_flag` reaches the plan's flag_target (a kernel bumps it as it
  // writes them); -1: once the source's start ran on its compute stream.
  int64_t src_flag = -1;
};

// An owned, checked copy of Attrs: an invocation outlives the call frame
// whose attribute memory the spans point into.
struct Plan {
  std::string op_name;
  // The program (lowered module, e.g. "jit_layer") the start belongs to:
  // messages about two programs waiting for each other name both.
  std::string program;
  int64_t site = 0;
  int64_t axis_size = 0;
  int64_t num_streams = 0;
  int64_t timeout_ms = 0;
  std::vector<int64_t> devices;
  std::vector<Transfer> transfers;
  // last_into[b]: index of the last transfer into landing buffer b (-1: none).
  // A forwarded copy of b may start once the source rank has issued it.
  std::vector<int64_t> last_into;
  // streams_used: the copy queues that carry at least one transfer.
  std::vector<int64_t> streams_used;
  // Flagged plans (num_flags > 0): the flags some transfer waits for.
  int64_t num_flags = 0;
  int64_t flag_target = 0;
  std::vector<int64_t> flags_used;
};

// Shape of one buffer in rows of `row_bytes` bytes.
struct BufferShape {
  int64_t rows;
  int64_t row_bytes;
};

// Where a device sits in the devices table.
struct Position {
  int64_t group;
  int64_t rank;
};

// Copies and checks the attributes against the buffers' shapes.
ffi::ErrorOr<Plan> MakePlan(const Attrs& attrs,
                            const std::vector<BufferShape>& sources,
                            const std::vector<BufferShape>& landings);

// Finds `device` in a devices table (group-major, rank-minor, whole groups
// of `axis_size`); an error message starts with `context`.
ffi::ErrorOr<Position> LocateIn(ffi::Span<const int64_t> devices,
                                 int64_t axis_size, int32_t device,
                                 std::string_view context);

// Finds `device` in the plan's devices table.
ffi::ErrorOr<Position> Locate(const Plan& plan, int32_t device);

// "ficco peer copy of 'op' (site 3) on device 2 (group 0, rank 2)": the
// prefix of every message of a handler that knows its invocation.
std::string Where(std::string_view phase, const Plan& plan, int32_t device,
                  Position pos);

}  // namespace ficco

#endif  // FICCO_XLA_FFI_PEER_COPY_PLAN_H_
