#!/usr/bin/env bash
# Builds libficco_ffi.so (CPU handlers) with Bazel, offline, and checks that
# it exports the FFI handlers. Needs python3 with jax installed (the FFI
# headers come from jax.ffi.include_dir()).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v bazel >/dev/null || [ ! -d /usr/share/bazel/rules/java ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq bazel-bootstrap bazel-rules-java >/dev/null
fi

export PYTHON_BIN_PATH="${PYTHON_BIN_PATH:-$(command -v python3)}"
bazel build //:libficco_ffi.so
for symbol in FiccoPeerCopyStartCpu FiccoPeerCopySyncCpu FiccoStartInstantiateCpu \
              FiccoCudaCompiled; do
  nm -D --defined-only bazel-bin/libficco_ffi.so | grep -qw "$symbol" \
    || { echo "bazel-bin/libficco_ffi.so does not export $symbol" >&2; exit 1; }
done
echo "bazel build OK: bazel-bin/libficco_ffi.so"
