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

#include "xla/ffi/api/ffi.h"

namespace ficco {

namespace ffi = ::xla::ffi;

// Attributes of ficco_peer_copy_start, decoded by XLA into one struct so both
// backends bind exactly the same names (member order = decoding order).
struct StartAttrs {
  ffi::Span<const int64_t> devices;     // ordinals, group-major, rank-minor
  int64_t axis_size;                    // P
  ffi::Span<const int64_t> dst;         // landing buffer of each transfer
  ffi::Span<const int64_t> dst_row;     // first row written there
  ffi::Span<const int64_t> src_offset;  // source rank = (rank + offset) % P
  ffi::Span<const int64_t> src;         // >= 0 operand, < 0 forwarded landing
  ffi::Span<const int64_t> src_row;     // first row read
  ffi::Span<const int64_t> rows;        // rows copied
  ffi::Span<const int64_t> stream;      // copy queue on the receiver
  ffi::Span<const int64_t> src_flag;    // source's completion flag, or -1
  int64_t num_streams;                  // queues per receiving device
  int64_t num_flags;                    // flags operand length (0: none)
  int64_t flag_target;                  // a flag's value once complete
  int64_t site;                         // call-site id (trace time)
  std::string_view op_name;             // for messages
  int64_t timeout_ms;                   // bound of every host wait
  std::string_view program;             // the lowered module, for messages
};

// Attributes of ficco_peer_copy_sync, which waits for landing buffers and
// ends invocations in one call. Its results alias operands [0, R) ("outs");
// outs [0, num_wait) are landing buffers to wait for; keepalive group g is
// operands [keep_bounds[g], keep_bounds[g + 1]), one per invocation to end,
// so keep_bounds[0] == R and its last entry is the operand count.
struct SyncAttrs {
  int64_t num_wait;                      // leading outs that are landings
  ffi::Span<const int64_t> keep_bounds;  // R, then each group's end
  std::string_view op_name;              // for messages
  int64_t timeout_ms;                    // bound of every host wait
};

// ficco_flags_arm: zeroes the completion flags and marks the landing
// buffers free on the compute stream, before the kernel that signals them.
// It also writes this device's rank on the axis (its position in `devices`,
// modulo `axis_size`), which the kernel reads: one handler call instead of
// XLA's partition-id and the fusion that converts it.
struct ArmAttrs {
  int64_t site;                      // the start's call site
  std::string_view op_name;          // for messages
  ffi::Span<const int64_t> devices;  // ordinals, group-major, rank-minor
  int64_t axis_size;                 // P
};

struct Transfer {
  int64_t dst, dst_row, src_offset, src, src_row, rows, stream;
  // >= 0: the source rows are complete once the source rank's flag
  // `src_flag` reaches the plan's flag_target (a kernel bumps it as it
  // writes them); -1: once the source's start ran on its compute stream.
  int64_t src_flag = -1;
};

// An owned, checked copy of StartAttrs: an invocation outlives the call frame
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
ffi::ErrorOr<Plan> MakePlan(const StartAttrs& attrs,
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

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::ficco::StartAttrs,
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("devices"),
    ::xla::ffi::StructMember<int64_t>("axis_size"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("dst"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("dst_row"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("src_offset"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("src"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("src_row"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("rows"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("stream"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("src_flag"),
    ::xla::ffi::StructMember<int64_t>("num_streams"),
    ::xla::ffi::StructMember<int64_t>("num_flags"),
    ::xla::ffi::StructMember<int64_t>("flag_target"),
    ::xla::ffi::StructMember<int64_t>("site"),
    ::xla::ffi::StructMember<std::string_view>("op_name"),
    ::xla::ffi::StructMember<int64_t>("timeout_ms"),
    ::xla::ffi::StructMember<std::string_view>("program"));

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::ficco::ArmAttrs, ::xla::ffi::StructMember<int64_t>("site"),
    ::xla::ffi::StructMember<std::string_view>("op_name"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("devices"),
    ::xla::ffi::StructMember<int64_t>("axis_size"));

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::ficco::SyncAttrs,
    ::xla::ffi::StructMember<int64_t>("num_wait"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("keep_bounds"),
    ::xla::ffi::StructMember<std::string_view>("op_name"),
    ::xla::ffi::StructMember<int64_t>("timeout_ms"));

#endif  // FICCO_XLA_FFI_PEER_COPY_PLAN_H_
