"""A repository holding the XLA FFI headers shipped with the installed jaxlib.

Runs python3 (or $PYTHON_BIN_PATH) to find jax.ffi.include_dir() and
symlinks it, so the headers always match the jaxlib that loads the library.
"""

_BUILD = """
cc_library(
    name = "headers",
    hdrs = glob(["include/xla/ffi/api/*.h"]),
    includes = ["include"],
    visibility = ["//visibility:public"],
)
"""

def _jax_ffi_headers_impl(rctx):
    python = rctx.os.environ.get("PYTHON_BIN_PATH") or rctx.which("python3")
    if not python:
        fail("python3 not found: set PYTHON_BIN_PATH to a Python with jax installed")
    result = rctx.execute([python, "-c", "import jax.ffi; print(jax.ffi.include_dir())"])
    if result.return_code != 0:
        fail("could not find the XLA FFI headers with %s (is jax installed?):\n%s" %
             (python, result.stderr))
    include_dir = result.stdout.strip()
    rctx.symlink(include_dir + "/xla", "include/xla")
    rctx.file("BUILD", _BUILD)

jax_ffi_headers = repository_rule(
    implementation = _jax_ffi_headers_impl,
    environ = ["PYTHON_BIN_PATH"],
    local = True,
)
