"""Test setup: 8 virtual CPU devices, or the local GPUs where there are >= 2.

Markers (pyproject.toml): ``gpu`` tests need a GPU and are skipped without
one; ``multigpu`` tests run their meshes on every local GPU where there are
at least 2 (else on the virtual CPU devices, with the CPU twin of the
copy-engine protocol), so ``pytest -m multigpu`` on a GPU host runs the GPU
suite; ``slow`` tests take tens of seconds (``-m "not slow"`` for a quick
run).
"""

import os

# Must happen before jax initialises its backends. Harmless on GPU hosts: it
# only sizes the CPU platform.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# On GPUs, allocate as needed rather than 75% of each GPU up front: the
# multi-process and thread tests start fresh interpreters that need memory
# on the same GPUs while this process holds what earlier tests left.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

jax.config.update("jax_enable_x64", True)


def pytest_collection_modifyitems(config, items):
  del config
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def user_cache(tmp_path):
  """The autotune cache file of one test (never ~/.cache), reset after it.
  Modules that autotune use it for every test (``pytest.mark.usefixtures``)."""
  import ficco_jax  # pylint: disable=g-import-not-at-top
  path = tmp_path / "autotune.json"
  ficco_jax.set_autotune_cache(path)
  yield path
  ficco_jax.set_autotune_cache(None)
