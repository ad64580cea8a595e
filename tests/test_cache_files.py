"""The autotune cache file under faults: corrupt, unwritable, written by
several processes at once. A cache must never take the library down, nor
lose what was measured."""

import json
import logging
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src.tuning import autotune_cache
import util

RING = Schedule(dataflow="ring", num_chunks=1, comm="xla")


@pytest.fixture(autouse=True)
def restore_cache_path():
  yield
  ficco_jax.set_autotune_cache(None)


def _key(rows=6):
  return autotune_cache.Key.of(
      "all_gather_matmul", device_kind=util.test_devices()[0].device_kind,
      axis_size=4, x_shape=(rows, 10), w_shape=(10, 7), axis=0,
      dtype=np.float32)


def _choose():
  return ficco_jax.choose_schedule("all_gather_matmul", x_shape=(6, 10),
                                   w_shape=(10, 7), dtype=np.float32,
                                   axis_size=4)


@pytest.mark.parametrize("contents", [
    b"\x00\xff garbage", b"", b'{"format": 1, "entries": [', b"[1, 2]",
    b"null", b'{"format": 1, "entries": [{"key": 3}]}',
    b'{"format": 1, "entries": {"a": 1}}'])
def test_a_corrupt_cache_is_ignored_with_a_warning_naming_it(
    tmp_path, caplog, contents):
  path = tmp_path / "autotune.json"
  path.write_bytes(contents)
  ficco_jax.set_autotune_cache(path)
  with caplog.at_level(logging.WARNING, logger="ficco_jax"):
    assert _choose() == Schedule(dataflow="none")  # The heuristic answers.
  assert str(path) in caplog.text and "ignoring the autotune cache" in caplog.text
  # The next store moves the broken file aside and starts a new one.
  with caplog.at_level(logging.WARNING, logger="ficco_jax"):
    autotune_cache.store(_key(), RING)
  assert autotune_cache.lookup(_key()) == RING
  aside = list(tmp_path.glob("autotune.json.corrupt-*"))
  assert len(aside) == 1 and aside[0].read_bytes() == contents


def test_a_cache_under_a_file_cannot_be_written_and_says_where(tmp_path):
  blocker = tmp_path / "not_a_dir"
  blocker.write_text("x")
  path = blocker / "autotune.json"
  ficco_jax.set_autotune_cache(path)
  with pytest.raises(OSError, match=f"autotune cache {path} cannot be written"):
    autotune_cache.store(_key(), RING)


def test_autotune_checks_the_cache_before_timing_anything(tmp_path):
  blocker = tmp_path / "not_a_dir"
  blocker.write_text("x")
  ficco_jax.set_autotune_cache(blocker / "autotune.json")
  mesh = util.mesh((4,), ("x",))
  x = util.put(mesh, P("x"), np.ones((24, 10), np.float32))
  w = util.put(mesh, P(None, "x"), np.ones((10, 28), np.float32))
  t0 = time.monotonic()
  with pytest.raises(OSError, match="cannot be written"):
    ficco_jax.autotune("all_gather_matmul", x, w, mesh=mesh, axis_name="x",
                       candidates=[RING], warmup=1, rounds=1, iters=1)
  assert time.monotonic() - t0 < 5  # Nothing was compiled or timed.


def test_autotune_returns_its_measurements_when_storing_fails(
    tmp_path, monkeypatch):
  ficco_jax.set_autotune_cache(tmp_path / "autotune.json")
  mesh = util.mesh((4,), ("x",))
  x = util.put(mesh, P("x"), np.ones((24, 10), np.float32))
  w = util.put(mesh, P(None, "x"), np.ones((10, 28), np.float32))

  def full_disk(*args, **kwargs):
    raise OSError("No space left on device")

  monkeypatch.setattr(autotune_cache, "store", full_disk)
  r = ficco_jax.autotune("all_gather_matmul", x, w, mesh=mesh, axis_name="x",
                         candidates=[RING, Schedule(dataflow="none")],
                         warmup=1, rounds=1, iters=1)
  assert r.cache_file is None and "No space left" in r.store_error
  assert {label for label, _ in r.timings_ms} == {RING.short(), "none/c1/xla/xla"}


_WRITER = """
import sys
import numpy as np
import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src.tuning import autotune_cache
ficco_jax.set_autotune_cache(sys.argv[1])
first, n = int(sys.argv[2]), int(sys.argv[3])
for rows in range(first, first + n):
  key = autotune_cache.Key.of("all_gather_matmul", device_kind="test",
                              axis_size=4, x_shape=(rows, 10),
                              w_shape=(10, 7), axis=0, dtype=np.float32)
  autotune_cache.store(key, Schedule(dataflow="ring", num_chunks=1))
"""


@pytest.mark.slow
def test_concurrent_writers_keep_every_entry(tmp_path):
  path = tmp_path / "autotune.json"
  script = tmp_path / "writer.py"
  script.write_text(_WRITER)
  n, procs = 60, 3
  runs = [subprocess.Popen([sys.executable, str(script), str(path),
                            str(1 + i * n), str(n)], cwd=tmp_path,
                           env=dict(os.environ, JAX_PLATFORMS="cpu",
                                    XLA_FLAGS=""))
          for i in range(procs)]
  assert [r.wait(timeout=300) for r in runs] == [0] * procs
  entries = json.loads(path.read_text())["entries"]
  rows = sorted(e["key"]["x_shape"][0] for e in entries)
  assert rows == list(range(1, 1 + n * procs))
  assert not list(pathlib.Path(tmp_path).glob("autotune.json.tmp*"))
