// Decoding and checking of the peer-copy plan (platform independent).

#include "peer_copy_plan.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace ficco {
namespace {

ffi::Unexpected<ffi::Error> Invalid(const Attrs& attrs,
                                    const std::string& what) {
  std::ostringstream os;
  os << "ficco peer copy of '" << attrs.op_name << "' (site " << attrs.site
     << "): invalid plan: " << what;
  return ffi::Unexpected(ffi::Error::InvalidArgument(os.str()));
}

}  // namespace

ffi::ErrorOr<Plan> MakePlan(const Attrs& attrs,
                            const std::vector<BufferShape>& sources,
                            const std::vector<BufferShape>& landings) {
  const size_t num_transfers = attrs.dst.size();
  for (const auto& column : {attrs.dst_row, attrs.src_offset, attrs.src,
                             attrs.src_row, attrs.rows, attrs.stream}) {
    if (column.size() != num_transfers) {
      return Invalid(attrs, "transfer attribute arrays differ in length");
    }
  }
  const int64_t p = attrs.axis_size;
  if (p < 1 || attrs.devices.size() == 0 ||
      attrs.devices.size() % static_cast<size_t>(p) != 0) {
    return Invalid(attrs, "devices table length " +
                              std::to_string(attrs.devices.size()) +
                              " is not a multiple of axis_size " +
                              std::to_string(p));
  }
  if (attrs.num_streams < 1) return Invalid(attrs, "num_streams < 1");
  if (attrs.timeout_ms < 1) return Invalid(attrs, "timeout_ms < 1");
  // An empty src_flag means no flags (the window transport's plans).
  if (!(attrs.src_flag.size() == 0) && attrs.src_flag.size() != num_transfers) {
    return Invalid(attrs, "src_flag length differs from the transfers'");
  }
  if (attrs.num_flags < 0 || (attrs.num_flags > 0 && attrs.flag_target < 1)) {
    return Invalid(attrs, "num_flags < 0, or flags with flag_target < 1");
  }
  if (sources.empty()) return Invalid(attrs, "no source operand");
  // Every buffer must share the row size: offsets are in rows, and a copy
  // between buffers of different rows would silently reshape the data.
  const int64_t row_bytes = sources[0].row_bytes;
  for (const auto* list : {&sources, &landings}) {
    for (const BufferShape& b : *list) {
      if (b.row_bytes != row_bytes) {
        return Invalid(attrs, "sources and landing buffers differ in row size");
      }
    }
  }

  Plan plan;
  plan.op_name = std::string(attrs.op_name);
  plan.program = std::string(attrs.program);
  plan.site = attrs.site;
  plan.axis_size = p;
  plan.num_streams = attrs.num_streams;
  plan.timeout_ms = attrs.timeout_ms;
  plan.devices.assign(attrs.devices.begin(), attrs.devices.end());
  plan.last_into.assign(landings.size(), -1);
  std::vector<bool> stream_used(attrs.num_streams, false);
  const int64_t num_landings = static_cast<int64_t>(landings.size());
  const int64_t num_sources = static_cast<int64_t>(sources.size());
  for (size_t i = 0; i < num_transfers; ++i) {
    Transfer t{attrs.dst[i], attrs.dst_row[i], attrs.src_offset[i],
               attrs.src[i], attrs.src_row[i], attrs.rows[i], attrs.stream[i],
               (attrs.src_flag.size() == 0) ? -1 : attrs.src_flag[i]};
    const std::string at = "transfer " + std::to_string(i) + ": ";
    if (t.src_flag < -1 || t.src_flag >= attrs.num_flags ||
        (t.src_flag >= 0 && t.src < 0)) {
      return Invalid(attrs, at + "src_flag outside -1..num_flags-1, or a"
                                 " flag on a forwarded landing buffer");
    }
    if (t.dst < 0 || t.dst >= num_landings) {
      return Invalid(attrs, at + "dst out of range");
    }
    if (t.rows < 0 || t.dst_row < 0 || t.dst_row + t.rows > landings[t.dst].rows) {
      return Invalid(attrs, at + "rows outside the landing buffer");
    }
    if (t.src_offset < 1 || t.src_offset >= p) {
      return Invalid(attrs, at + "src_offset outside 1..P-1");
    }
    if (t.stream < 0 || t.stream >= attrs.num_streams) {
      return Invalid(attrs, at + "stream outside 0..num_streams-1");
    }
    int64_t src_rows;
    if (t.src >= 0) {
      if (t.src >= num_sources) return Invalid(attrs, at + "src out of range");
      src_rows = sources[t.src].rows;
    } else {
      const int64_t forwarded = -1 - t.src;
      if (forwarded >= num_landings) {
        return Invalid(attrs, at + "forwarded landing buffer out of range");
      }
      // The source rank receives that buffer through an earlier transfer of
      // the same plan; a later one would make ranks wait on each other.
      if (plan.last_into[forwarded] < 0) {
        return Invalid(attrs, at + "forwards a landing buffer not yet filled");
      }
      src_rows = landings[forwarded].rows;
    }
    if (t.src_row < 0 || t.src_row + t.rows > src_rows) {
      return Invalid(attrs, at + "rows outside the source buffer");
    }
    plan.last_into[t.dst] = static_cast<int64_t>(i);
    stream_used[t.stream] = true;
    plan.transfers.push_back(t);
  }
  for (int64_t s = 0; s < attrs.num_streams; ++s) {
    if (stream_used[s]) plan.streams_used.push_back(s);
  }
  plan.num_flags = attrs.num_flags;
  plan.flag_target = attrs.flag_target;
  std::vector<bool> flag_used(attrs.num_flags, false);
  for (const Transfer& t : plan.transfers) {
    if (t.src_flag >= 0) flag_used[t.src_flag] = true;
  }
  for (int64_t f = 0; f < attrs.num_flags; ++f) {
    if (flag_used[f]) plan.flags_used.push_back(f);
  }
  return plan;
}

ffi::ErrorOr<Position> LocateIn(ffi::Span<const int64_t> devices,
                                 int64_t axis_size, int32_t device,
                                 std::string_view context) {
  const auto* begin = devices.begin();
  const auto* end = devices.end();
  const auto* it = std::find(begin, end, device);
  const bool whole_groups =
      axis_size > 0 && devices.size() % static_cast<size_t>(axis_size) == 0;
  if (!whole_groups || it == end || std::find(it + 1, end, device) != end) {
    std::ostringstream os;
    os << context << ": ";
    if (!whole_groups) {
      os << "the devices table's " << devices.size()
         << " entries are not whole groups of axis_size " << axis_size;
    } else {
      os << "device ordinal " << device
         << (it == end ? " is not" : " is more than once")
         << " in the devices table";
    }
    os << " [";
    for (size_t i = 0; i < devices.size(); ++i) {
      os << (i ? ", " : "") << devices[i];
    }
    os << "]";
    return ffi::Unexpected(ffi::Error::InvalidArgument(os.str()));
  }
  const int64_t index = it - begin;
  return Position{index / axis_size, index % axis_size};
}

ffi::ErrorOr<Position> Locate(const Plan& plan, int32_t device) {
  std::ostringstream context;
  context << "ficco peer copy of '" << plan.op_name << "' (site " << plan.site
          << ")";
  return LocateIn(ffi::Span<const int64_t>(plan.devices.data(),
                                           plan.devices.size()),
                  plan.axis_size, device, context.str());
}

std::string Where(std::string_view phase, const Plan& plan, int32_t device,
                  Position pos) {
  std::ostringstream os;
  os << "ficco peer copy " << phase << " of '" << plan.op_name << "' (site "
     << plan.site << ") in '" << plan.program << "' on device " << device
     << " (group " << pos.group
     << ", rank " << pos.rank << " of " << plan.axis_size << ")";
  return os.str();
}

}  // namespace ficco
