"""Suite ``peers``: PyTorch async-TP on the same cases, with the same method.

Starts ``torchrun --nproc-per-node W`` (as ``python -m
torch.distributed.run``) on suites/peers_worker.py, which times PyTorch's
fused ops (``torch.ops.symm_mem.fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``) against NCCL + cuBLAS. NVLink multicast
stays off in the children (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1``). This process never starts
JAX's GPU backend (it would take the children's GPU memory): the device name
comes from nvidia-smi. The ops suite's report merges ``peers.json`` from the
same folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from absl import flags

from lib import cases as cases_lib
from lib import meta as meta_lib
from lib import options
from lib import report
from lib import results

FLAGS = flags.FLAGS
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "peers_worker.py")
NO_MULTICAST = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


def run() -> int:
  kind = meta_lib.gpu_name_without_jax() or "cpu"
  w = FLAGS.axis_size or meta_lib.gpu_count_without_jax() or 1
  directory = results.out_dir(kind, w)
  out = os.path.join(directory, "peers.json")
  if importlib.util.find_spec("torch") is None:
    data = {"meta": meta_lib.collect("peers", devices=False),
            "axis_size": w, "cases": [],
            "skipped": [{"what": "peers", "reason": "torch is not installed"
                         f" for {sys.executable}"}]}
    results.Recorder("peers", directory, data, markdown).finish()
    return 0
  spec = {"command": meta_lib.command(), "out": out,
          "time_budget_s": FLAGS.time_budget_s,
          "timing": {"warmup": FLAGS.warmup, "rounds": FLAGS.rounds,
                     "iters": FLAGS.iters, "input_sets": FLAGS.input_sets,
                     "stat": "CUDA events; median and min over rounds of"
                             " round_time / iters"},
          "cases": [{"op": op, "name": c.name, "m": c.m, "k": c.k, "n": c.n}
                    for op in FLAGS.ops for c in options.case_list(op)]}
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(spec, f)
  cmd = [sys.executable, "-m", "torch.distributed.run",
         f"--nproc-per-node={w}", WORKER, f"--spec={f.name}"]
  print("running:", " ".join(cmd), flush=True)
  env = dict(os.environ, **NO_MULTICAST)
  timeout = FLAGS.time_budget_s * 1.5 + 300 if FLAGS.time_budget_s else None
  try:
    code = subprocess.run(cmd, env=env, timeout=timeout,
                          check=False).returncode
  except subprocess.TimeoutExpired:
    code = 124
  finally:
    os.unlink(f.name)
  try:
    with open(out) as fh:
      data = json.load(fh)
  except (OSError, json.JSONDecodeError) as e:
    data = {"meta": meta_lib.collect("peers", devices=False), "cases": [],
            "axis_size": w,
            "skipped": [{"what": "peers", "reason": f"torchrun exit {code};"
                         f" no result ({results.short_error(e, 200)})"}]}
  if code:
    data.setdefault("skipped", []).append(
        {"what": "torchrun", "reason": f"exit code {code}"})
  results.Recorder("peers", directory, data, markdown).finish()
  return code


def markdown(data: dict) -> str:
  m = data["meta"]
  lines = [f"# PyTorch async-TP, W={data.get('axis_size')}", ""]
  lines += report.provenance(m)
  if m.get("torch"):
    lines.append(f"- torch {m['torch']}, CUDA {m.get('cuda')}, NCCL"
                 f" {m.get('nccl')}")
  lines += ["", "ms per call, median over rounds (min); speedup of the fused"
            " op over PyTorch's own NCCL + cuBLAS.", ""]
  rows = []
  for c in data.get("cases", []):
    b = c["baselines"]
    f = (c.get("methods") or [{}])[0]
    rows.append([cases_lib.OPS[c["op"]], c["name"], f"{c['M']}x{c['K']}x{c['N']}",
                 report.times(b.get("matmul")), report.times(b.get("comm")),
                 report.times(b.get("nccl_mm")), report.num(c.get("ideal_ms")),
                 report.times(f) + (f" ({report.num(f.get('speedup'), 2)}x)"
                                    if f.get("speedup") else
                                    f" {f.get('error', '')[:100]}"),
                 report.num(f.get("rel_err"), 4)])
  lines += report.table(["op", "case", "M x K x N", "matmul", "comm",
                         "NCCL + mm", "ideal", "torch fused (x)", "rel err"],
                        rows)
  return "\n".join(lines + report.skipped(data)) + "\n"
