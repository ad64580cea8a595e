"""What every result file records about the run that made it."""

from __future__ import annotations

import datetime
import functools
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
ENV_PREFIXES = ("NCCL_", "XLA_", "JAX_", "CUDA_VISIBLE_DEVICES",
                "TORCH_SYMM_MEM_", "NVSHMEM_")


def slug(device_kind: str) -> str:
  """``"NVIDIA H200"`` -> ``"nvidia_h200"`` (result folder names)."""
  return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") or "unknown"


def command() -> str:
  """This process's command line, as a shell would take it."""
  return " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])


def env() -> dict[str, str]:
  """The environment that changes what runs (XLA, NCCL, visible GPUs)."""
  return {k: v for k, v in sorted(os.environ.items())
          if k.startswith(ENV_PREFIXES)}


def _git(*args: str, env: dict[str, str] | None = None) -> str:
  return subprocess.run(["git", "-C", REPO, *args], capture_output=True,
                        text=True, timeout=60, check=True,
                        env=env).stdout.strip()


def git_commit() -> str | None:
  """``HEAD`` of the checkout the benchmarks live in (``+dirty`` if edited)."""
  try:
    head = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return None


def git_tree() -> str | None:
  """The git tree id of the files that ran: tracked and untracked ones that
  git does not ignore, edited or not, through a scratch index (the
  checkout's own is left alone).

  A tree id depends on the files' contents alone, so a copy of a working
  tree whose ``HEAD`` is older than its files (a GPU host's copy, say) is
  still traced to the commit that holds the same files
  (`commit_of_tree`, which the report uses).
  """
  import tempfile  # pylint: disable=g-import-not-at-top
  try:
    with tempfile.TemporaryDirectory() as scratch:
      env = dict(os.environ, GIT_INDEX_FILE=os.path.join(scratch, "index"))
      _git("read-tree", "HEAD", env=env)
      _git("add", "-A", env=env)
      return _git("write-tree", env=env)
  except (OSError, subprocess.SubprocessError):
    return None


@functools.lru_cache(maxsize=None)
def commit_of_tree(tree: str | None) -> str | None:
  """The newest commit of this checkout whose tree is ``tree``, or None."""
  if not tree:
    return None
  try:
    for line in _git("log", "--all", "--format=%H %T").splitlines():
      commit, t = line.split()
      if t == tree:
        return commit
  except (OSError, subprocess.SubprocessError, ValueError):
    pass
  return None


def gpu_name_without_jax() -> str | None:
  """The first GPU's name from nvidia-smi, for suites that must not start
  JAX's GPU backend (it would take GPU memory from their children)."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30,
                         check=True).stdout.splitlines()
  except (OSError, subprocess.SubprocessError):
    return None
  return out[0].strip() if out else None


def gpu_count_without_jax() -> int:
  """The host's GPUs from nvidia-smi (0 without it), likewise."""
  from ficco_jax import launch  # pylint: disable=g-import-not-at-top
  return launch.count_gpus()


def collect(suite: str, *, devices: bool = True) -> dict[str, Any]:
  """The run's metadata; ``devices`` adds JAX's device kind and count."""
  info: dict[str, Any] = {
      "suite": suite,
      "command": command(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "host": socket.gethostname(),
      "python": platform.python_version(),
      "git_commit": git_commit(),
      "git_tree": git_tree(),
      "env": env(),
  }
  try:
    import jax  # pylint: disable=g-import-not-at-top
    import jaxlib  # pylint: disable=g-import-not-at-top
    info["jax"], info["jaxlib"] = jax.__version__, jaxlib.__version__
  except ImportError as e:
    info["jax"] = f"not importable: {e}"
  try:
    import ficco_jax  # pylint: disable=g-import-not-at-top
    info["ficco_jax"] = getattr(ficco_jax, "__version__", "unknown")
    info["ficco_jax_file"] = ficco_jax.__file__
  except ImportError as e:
    info["ficco_jax"] = f"not importable: {e}"
  if devices:
    import jax  # pylint: disable=g-import-not-at-top
    devs = jax.devices()
    info.update(platform=devs[0].platform, device_kind=devs[0].device_kind,
                device_count=len(devs), process_count=jax.process_count())
  return info
