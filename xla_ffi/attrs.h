// The attributes of every ficco handler: one struct, decoded by XLA for
// every call of every handler on both platforms, and built on the Python
// side by one function (ficco_jax/_src/dma/attrs.py), which fills the
// fields a handler does not read with their defaults. XLA requires the
// attribute set to match the struct exactly, so a name added here must be
// added there too, and the two cannot drift apart silently: a mismatch
// fails every call with XLA's "Wrong number of attributes".
//
// Why one struct: the transports share most of what they are told (who
// calls, the group, the bound of every wait, the copy table), and one
// definition keeps the handlers from growing copies of each other's fields.

#ifndef FICCO_XLA_FFI_ATTRS_H_
#define FICCO_XLA_FFI_ATTRS_H_

#include <cstdint>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace ficco {

namespace ffi = ::xla::ffi;

struct Attrs {
  // Who calls, for messages, and the bound of every wait.
  std::string_view op_name;  // the op ("all_gather_matmul", ...)
  std::string_view program;  // the lowered module, e.g. "jit_layer"
  int64_t site;              // call-site id (trace time)
  int64_t timeout_ms;        // bound of every wait
  int64_t window;            // window family (window, push), else -1

  // The group: device of each rank (rendezvous: local ordinals; window and
  // push: global ids, for messages), group-major, rank-minor, and P.
  ffi::Span<const int64_t> devices;
  int64_t axis_size;

  // The copy table, one entry per copy (a rendezvous/window start's
  // transfer, a push start's piece).
  ffi::Span<const int64_t> dst;         // landing buffer
  ffi::Span<const int64_t> dst_row;     // first row written there
  ffi::Span<const int64_t> src_offset;  // source rank = (rank + offset) % P
  ffi::Span<const int64_t> shift;       // push: receiver = (rank + shift) % P
  ffi::Span<const int64_t> src;         // >= 0 operand, < 0 forwarded landing
  ffi::Span<const int64_t> src_row;     // first row read
  ffi::Span<const int64_t> rows;        // rows copied
  ffi::Span<const int64_t> stream;      // copy queue on the receiver
  ffi::Span<const int64_t> src_flag;    // completion flag of the source, or -1
  int64_t num_streams;                  // queues per receiving device
  int64_t num_flags;                    // flags operand length (0: none)
  int64_t flag_target;                  // a flag's value once complete

  // Rendezvous sync: results alias operands [0, R); outs [0, num_wait) are
  // landing buffers to wait for; keepalive group g is operands
  // [keep_bounds[g], keep_bounds[g + 1]), one per invocation to end.
  int64_t num_wait;
  ffi::Span<const int64_t> keep_bounds;

  // Push layout: the own rows of the result, the landed pieces' rows and
  // count, and the size of one landing half of the window.
  int64_t own_row;
  int64_t chunk_rows;
  int64_t num_chunks;
  int64_t half_bytes;

  // Window start: its last result is int32[transfers], flag i set to 1 by
  // transfer i's copy queue once that transfer has landed (a consumer
  // kernel waits on them on the device; docs/windows.md, "Landing flags").
  // Window wait: only until the copies and flag writes are enqueued, on the
  // host (the kernel after it waits on the device).
  int64_t landed;
};

}  // namespace ficco

// Member order = decoding order; names as attrs.py spells them.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::ficco::Attrs,
    ::xla::ffi::StructMember<std::string_view>("op_name"),
    ::xla::ffi::StructMember<std::string_view>("program"),
    ::xla::ffi::StructMember<int64_t>("site"),
    ::xla::ffi::StructMember<int64_t>("timeout_ms"),
    ::xla::ffi::StructMember<int64_t>("window"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("devices"),
    ::xla::ffi::StructMember<int64_t>("axis_size"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("dst"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("dst_row"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("src_offset"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("shift"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("src"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("src_row"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("rows"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("stream"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("src_flag"),
    ::xla::ffi::StructMember<int64_t>("num_streams"),
    ::xla::ffi::StructMember<int64_t>("num_flags"),
    ::xla::ffi::StructMember<int64_t>("flag_target"),
    ::xla::ffi::StructMember<int64_t>("num_wait"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("keep_bounds"),
    ::xla::ffi::StructMember<int64_t>("own_row"),
    ::xla::ffi::StructMember<int64_t>("chunk_rows"),
    ::xla::ffi::StructMember<int64_t>("num_chunks"),
    ::xla::ffi::StructMember<int64_t>("half_bytes"),
    ::xla::ffi::StructMember<int64_t>("landed"));

#endif  // FICCO_XLA_FFI_ATTRS_H_
