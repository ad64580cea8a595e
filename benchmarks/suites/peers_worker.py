"""One rank of suite ``peers`` (started by it under torchrun; not a CLI).

all_gather_matmul ("ag"), per rank: A [M/W, K] @ B [K, N/W] -> [M, N/W]
  matmul   A_full [M, K] @ B alone
  comm     dist.all_gather_into_tensor alone
  nccl_mm  all_gather_into_tensor then matmul (PyTorch's unfused baseline)
  torch    torch.ops.symm_mem.fused_all_gather_matmul(A, [B], 0, group)
matmul_reduce_scatter ("rs"), per rank: A [M, K/W] @ B [K/W, N] -> [M/W, N]
  matmul   A @ B alone
  comm     dist.reduce_scatter_tensor alone
  nccl_mm  matmul then reduce_scatter_tensor
  torch    torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, "sum", 0, group)

Timing: lib.timing.time_torch (CUDA events over rounds of back-to-back
calls, ranks aligned by a barrier before every round). Rank 0 rewrites the
JSON after every case (``median_ms`` is rank 0's, ``median_ms_max_rank``
the slowest rank's).
"""

from __future__ import annotations

import os

# NVLink multicast must stay off on the shared GPU hosts (a program that
# uses it can take the host's GPUs out of service): set before torch loads.
# The suite sets them in this process's environment too.
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lib import meta as meta_lib  # noqa: E402
from lib import results  # noqa: E402
from lib import timing  # noqa: E402


def rel_err(out, ref) -> float:
  out, ref = out.float(), ref.float()
  return float((out - ref).norm() / ref.norm())


def randn(shape, seed, device):
  import torch
  g = torch.Generator(device=device)  # Per-device stream: no host copy.
  g.manual_seed(seed)
  return torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)


class Worker:
  """One rank: the process group, the timing, rank 0's eager writes."""

  def __init__(self, spec: dict):
    import torch
    import torch.distributed as dist
    self.spec = spec
    self.t0 = time.perf_counter()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=180)  # A hang becomes an error.
    self.cuda = torch.cuda.is_available()
    if self.cuda:
      torch.cuda.set_device(local_rank)
      self.device = torch.device("cuda", local_rank)
      dist.init_process_group("nccl", device_id=self.device, timeout=timeout)
    else:  # CPU smoke runs: gloo; the fused ops then fail and are recorded.
      self.device = torch.device("cpu")
      dist.init_process_group("gloo", timeout=timeout)
    self.rank, self.w = dist.get_rank(), dist.get_world_size()
    self.group_name = dist.group.WORLD.group_name
    notes = {}
    try:
      import torch.distributed._symmetric_memory as symm_mem
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Deprecated (a no-op) in new torch.
        symm_mem.enable_symm_mem_for_group(self.group_name)
    except Exception as e:  # pylint: disable=broad-except
      notes["enable_symm_mem_for_group"] = results.short_error(e)
    meta = dict(meta_lib.collect("peers", devices=False),
                command=spec["command"], worker_command=meta_lib.command())
    nccl = torch.cuda.nccl.version() if self.cuda else None
    meta.update(torch=torch.__version__, cuda=torch.version.cuda,
                nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple)
                else str(nccl),
                device_kind=(torch.cuda.get_device_name() if self.cuda
                             else "cpu"),
                device_count=self.w, platform="gpu" if self.cuda else "cpu",
                notes=notes)
    self.data = {"meta": meta, "timing": spec["timing"], "axis_size": self.w,
                 "cases": [], "skipped": [], "in_progress": None}

  def barrier(self) -> None:
    import torch.distributed as dist
    if self.cuda:
      dist.barrier(device_ids=[self.device.index])
    else:
      dist.barrier()

  def over_budget(self) -> bool:
    """Rank 0 decides for everyone, so no rank skips a collective alone."""
    import torch.distributed as dist
    budget = self.spec["time_budget_s"]
    flag = [budget > 0 and time.perf_counter() - self.t0 > budget]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])

  def save(self, what=None) -> None:
    if self.rank != 0:
      return
    self.data["in_progress"] = what
    self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
    if what:
      print(f"[{self.data['elapsed_s']:7.1f}s] {what}", flush=True)
    results.write_json(self.spec["out"], self.data)

  def timed(self, label, fn, n_sets) -> dict:
    """Times fn(i) on every rank; gathers every rank's median."""
    import torch
    import torch.distributed as dist
    self.save(label)
    t = self.spec["timing"]
    try:
      res = timing.time_torch(fn, num_arg_sets=n_sets, warmup=t["warmup"],
                              rounds=t["rounds"], iters=t["iters"],
                              barrier=self.barrier)
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc(limit=3)
      res = {"error": results.short_error(e)}
    if self.cuda:
      torch.cuda.synchronize()
    meds = [None] * self.w
    dist.all_gather_object(meds, res.get("median_ms"))
    if res.get("median_ms") is not None:
      res["median_ms_per_rank"] = meds
      res["median_ms_max_rank"] = max(v for v in meds if v is not None)
    return res

  def baselines(self, rec, n_sets, *, matmul, comm, unfused) -> None:
    """The matmul alone, the NCCL collective alone, and both one after the
    other (PyTorch's unfused program), each called as ``fn(input set)``."""
    tag = f"{rec['op']} {rec['name']} W={rec['W']}"
    for key, fn in (("matmul", matmul), ("comm", comm), ("nccl_mm", unfused)):
      rec["baselines"][key] = self.timed(f"{tag} {key}", fn, n_sets)

  def fused(self, rec, fused, unfused, ref32, n_sets) -> None:
    """Checks the fused op once against f32 and NCCL + cuBLAS, then times it."""
    tag = f"{rec['op']} {rec['name']} W={rec['W']}"
    entry = {"method": "torch", "label": rec["op_name"]}
    try:
      self.save(f"{tag} check")
      ref = unfused(0).clone()
      out = fused(0)
      entry.update(rel_err=rel_err(out, ref32), rel_err_vs_nccl_mm=rel_err(
          out, ref), rel_err_nccl_mm=rel_err(ref, ref32))
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc(limit=3)
      entry["error"] = results.short_error(e)
    if "error" not in entry:
      entry.update(self.timed(f"{tag} fused", fused, n_sets))
    rec["methods"].append(entry)


def _record(op: str, op_name: str, name: str, w: int, m, k, n) -> dict:
  return {"op": op, "op_name": op_name, "name": name, "W": w, "M": m, "K": k,
          "N": n, "baselines": {}, "methods": []}


def bench_ag(wk: Worker, name, m_glob, k, n_glob) -> dict:
  import torch
  import torch.distributed as dist
  w, dev, r = wk.w, wk.device, wk.rank
  m, n = m_glob // w, n_glob // w
  s = max(1, wk.spec["timing"]["input_sets"])
  a_sh = [randn((m, k), 1000 * i + r, dev) for i in range(s)]
  bs = [randn((k, n), 1000 * i + 500 + r, dev) for i in range(s)]
  # Random, not empty: the matmul-alone baseline reads it before any gather.
  a_full = [randn((m_glob, k), 1000 * i + 300, dev) for i in range(s)]
  rec = _record("ag", "fused_all_gather_matmul", name, w, m_glob, k, n_glob)

  def nccl_mm(i):
    dist.all_gather_into_tensor(a_full[i], a_sh[i])
    return torch.matmul(a_full[i], bs[i])
  wk.baselines(rec, s, matmul=lambda i: torch.matmul(a_full[i], bs[i]),
               comm=lambda i: dist.all_gather_into_tensor(a_full[i], a_sh[i]),
               unfused=nccl_mm)
  op = torch.ops.symm_mem.fused_all_gather_matmul
  kw = {"return_A": False} if "return_A" in str(
      getattr(op.default, "_schema", "")) else {}
  nccl_mm(0)
  ref32 = a_full[0].float() @ bs[0].float()
  wk.fused(rec, lambda i: op(a_sh[i], [bs[i]], 0, wk.group_name,
                             **kw)[1][0], nccl_mm, ref32, s)
  return rec


def bench_rs(wk: Worker, name, m_glob, k_glob, n) -> dict:
  import torch
  import torch.distributed as dist
  w, dev, r = wk.w, wk.device, wk.rank
  m, k = m_glob // w, k_glob // w
  s = max(1, wk.spec["timing"]["input_sets"])
  a = [randn((m_glob, k), 1000 * i + r, dev) for i in range(s)]
  bs = [randn((k, n), 1000 * i + 500 + r, dev) for i in range(s)]
  partial = [randn((m_glob, n), 1000 * i + 700 + r, dev) for i in range(s)]
  outs = [torch.empty((m, n), dtype=torch.bfloat16, device=dev)
          for _ in range(s)]
  rec = _record("rs", "fused_matmul_reduce_scatter", name, w, m_glob, k_glob,
                n)

  def mm_nccl(i):
    dist.reduce_scatter_tensor(outs[i], torch.matmul(a[i], bs[i]))
    return outs[i]
  wk.baselines(rec, s, matmul=lambda i: torch.matmul(a[i], bs[i]),
               comm=lambda i: dist.reduce_scatter_tensor(outs[i], partial[i]),
               unfused=mm_nccl)
  ref32 = torch.empty((m, n), dtype=torch.float32, device=dev)
  dist.reduce_scatter_tensor(ref32, a[0].float() @ bs[0].float())
  op = torch.ops.symm_mem.fused_matmul_reduce_scatter
  wk.fused(rec, lambda i: op(a[i], bs[i], "sum", 0, wk.group_name),
           mm_nccl, ref32, s)
  return rec


def summarize(rec: dict) -> None:
  """Ideal and speedup over PyTorch's own unfused baseline."""
  b = rec["baselines"]
  t_mm = b.get("matmul", {}).get("median_ms")
  t_comm = b.get("comm", {}).get("median_ms")
  t_seq = b.get("nccl_mm", {}).get("median_ms")
  rec["ideal_ms"] = max(t_mm, t_comm) if t_mm and t_comm else None
  for m in rec["methods"]:
    t = m.get("median_ms")
    if t and t_seq:
      m["speedup"] = t_seq / t
      m["frac_ideal"] = rec["ideal_ms"] / t if rec["ideal_ms"] else None


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--spec", required=True, help="JSON written by suite peers.")
  with open(p.parse_args().spec) as f:
    spec = json.load(f)
  import torch
  import torch.distributed as dist
  wk = Worker(spec)
  torch.backends.cuda.matmul.allow_tf32 = False  # f32 references stay f32.
  for c in spec["cases"]:
    what = f"{c['op']} {c['name']} W={wk.w}"
    if wk.over_budget():
      wk.data["skipped"].append({"what": what, "reason": "time budget"})
      continue
    if c["m"] % wk.w or (c["n"] if c["op"] == "ag" else c["k"]) % wk.w:
      wk.data["skipped"].append({"what": what, "reason": "not divisible by W"})
      continue
    try:
      fn = bench_ag if c["op"] == "ag" else bench_rs
      rec = fn(wk, c["name"], c["m"], c["k"], c["n"])
      summarize(rec)
      wk.data["cases"].append(rec)
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      wk.data["skipped"].append({"what": what, "reason": results.short_error(e)})
    if wk.cuda:
      torch.cuda.empty_cache()
    wk.save(None)
  wk.save(None)
  wk.barrier()
  dist.destroy_process_group()


if __name__ == "__main__":
  main()
