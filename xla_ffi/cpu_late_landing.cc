// The late-landing test hook's CPU twin (late_landing.h): everything lands
// before the call returns.

#include <cstdint>
#include <cstring>

#include "attrs.h"
#include "ficco_ffi.h"
#include "late_landing.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {
namespace {

ffi::Error LateLandingImpl(ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> landing,
                           ffi::Result<ffi::AnyBuffer> flags,
                           ffi::Result<ffi::AnyBuffer> src_out, Attrs attrs) {
  if (src.untyped_data() != src_out->untyped_data()) {
    return ffi::Error::Internal("ficco late-landing hook: src not aliased");
  }
  auto l = CheckLateLanding(src, *landing, *flags, attrs);
  if (!l.has_value()) return l.error();
  std::memcpy(landing->untyped_data(), src.untyped_data(), src.size_bytes());
  auto* f = static_cast<int32_t*>(flags->untyped_data());
  for (int64_t i = 0; i < l->pieces; ++i) f[i] = 1;
  return ffi::Error::Success();
}

// Nothing lands late on CPU.
ffi::Error JoinImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  if (x.untyped_data() != out->untyped_data()) {
    return ffi::Error::Internal("ficco late-landing join: not aliased");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ficco

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoTestLateLandingCpu, ficco::LateLandingImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // src
                                  .Ret<xla::ffi::AnyBuffer>()  // landing
                                  .Ret<xla::ffi::AnyBuffer>()  // flags
                                  .Ret<xla::ffi::AnyBuffer>()  // src, aliased
                                  .Attrs<ficco::Attrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoTestLateLandingJoinCpu, ficco::JoinImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Ret<xla::ffi::AnyBuffer>());  // aliased
