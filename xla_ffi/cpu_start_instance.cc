// The CPU start handlers' instantiate stage and its state type
// (start_instance.h); library.py registers the type, then the handlers.

#include <memory>

#include "start_instance.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

ffi::TypeId StartInstance::id = {};

namespace {

constexpr XLA_FFI_TypeInfo kStartInstanceInfo =
    ffi::MakeTypeInfo<StartInstance>();

// Bound to every operand, result and attribute, which it ignores: one
// instantiate handler serves every start target.
ffi::ErrorOr<std::unique_ptr<StartInstance>> Instantiate(ffi::RemainingArgs,
                                                         ffi::RemainingRets,
                                                         ffi::Dictionary) {
  return std::make_unique<StartInstance>();
}

}  // namespace
}  // namespace ficco

XLA_FFI_DEFINE_HANDLER_SYMBOL(FiccoStartInstantiateCpu, ficco::Instantiate,
                              xla::ffi::Ffi::BindInstantiate()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs());

extern "C" void* FiccoStartInstanceTypeId() {
  return &ficco::StartInstance::id;
}

extern "C" const void* FiccoStartInstanceTypeInfo() {
  return &ficco::kStartInstanceInfo;
}
