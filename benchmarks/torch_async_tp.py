"""PyTorch async-TP peers: symm_mem fused ops vs NCCL + cuBLAS, same cases.

Run one process per GPU:

  torchrun --nproc-per-node 4 benchmarks/torch_async_tp.py \
      --models=llama3-70b --tokens=8192 --out_dir=benchmarks/results

all_gather_matmul ("ag"), per rank: A [M/W, K] @ B [K, N/W] -> [M, N/W]
  matmul     A_full [M, K] @ B alone,
  comm       dist.all_gather_into_tensor alone,
  nccl_mm    all_gather_into_tensor then matmul (T_seq),
  torch      torch.ops.symm_mem.fused_all_gather_matmul(A, [B], 0, group).
matmul_reduce_scatter ("rs"), per rank: A [M, K/W] @ B [K/W, N] -> [M/W, N]
  matmul     A @ B alone,
  comm       dist.reduce_scatter_tensor alone,
  nccl_mm    matmul then reduce_scatter_tensor (T_seq),
  torch      torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, "sum", 0,
             group).
Timing: timing.time_torch (CUDA events over rounds of back-to-back calls,
ranks aligned by a barrier before every round), the same warm-up, rounds
and iterations as the JAX scripts. Rank 0 writes torch_<tag>.json/.md with
each rank's median (``median_ms`` is rank 0's, ``median_ms_max_rank`` the
slowest rank's).
"""

from __future__ import annotations

import os

# NVLink multicast must stay off on the lent machines (a program that uses it
# can take the host's shared GPUs out of service): set before torch loads.
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import timing  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  lst = lambda s: [v for v in s.split(",") if v]  # noqa: E731
  p.add_argument("--models", type=lst, default=["llama3-70b", "llama3-8b"])
  p.add_argument("--tokens", type=lst, default=["8192", "4096", "16384"])
  p.add_argument("--square", type=int, default=1)
  p.add_argument("--cases", type=lst, default=[])
  p.add_argument("--ops", type=lst, default=["ag", "rs"])
  p.add_argument("--shapes", default=os.path.join(HERE, "shapes.json"))
  p.add_argument("--out_dir", default=os.path.join(HERE, "results"))
  p.add_argument("--tag", default=None)
  p.add_argument("--time_budget_s", type=float, default=0.0)
  p.add_argument("--warmup", type=int, default=timing.WARMUP)
  p.add_argument("--rounds", type=int, default=timing.ROUNDS)
  p.add_argument("--iters", type=int, default=timing.ITERS)
  p.add_argument("--input_sets", type=int, default=2)
  p.add_argument("--tiny", type=int, default=0)
  return p.parse_args(argv)


def _err(e: BaseException, limit: int = 1500) -> str:
  msg = f"{type(e).__name__}: {e}"
  if len(msg) > limit:
    msg = msg[:limit // 2] + " ... " + msg[-limit // 2:]
  return msg


def _nccl_version() -> str:
  import torch
  try:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
  except Exception as e:  # pylint: disable=broad-except
    return f"unknown ({_err(e, 100)})"


def rel_err(out, ref) -> float:
  out, ref = out.float(), ref.float()
  return float((out - ref).norm() / ref.norm())


class Bench:
  """State of one torchrun job: the group, results, eager writes."""

  def __init__(self, args):
    import torch
    import torch.distributed as dist
    self.args = args
    self.t0 = time.perf_counter()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=180)  # A hang becomes an error.
    self.cuda = torch.cuda.is_available()
    if self.cuda:
      torch.cuda.set_device(local_rank)
      self.device = torch.device("cuda", local_rank)
      dist.init_process_group("nccl", device_id=self.device, timeout=timeout)
    else:  # CPU smoke test: gloo; the fused ops then fail and are recorded.
      self.device = torch.device("cpu")
      dist.init_process_group("gloo", timeout=timeout)
    self.rank, self.w = dist.get_rank(), dist.get_world_size()
    self.group = dist.group.WORLD
    self.group_name = self.group.group_name
    self.notes = {}
    try:
      import torch.distributed._symmetric_memory as symm_mem
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Deprecated (a no-op) in new torch.
        symm_mem.enable_symm_mem_for_group(self.group_name)
    except Exception as e:  # pylint: disable=broad-except
      self.notes["enable_symm_mem_for_group"] = _err(e)
    tag = args.tag or f"{self.device_name().replace(' ', '_')}_{self.w}gpu"
    self.json_path = os.path.join(args.out_dir, f"torch_{tag}.json")
    self.md_path = os.path.join(args.out_dir, f"torch_{tag}.md")
    self.data = {"meta": self.meta(), "cases": [], "skipped": [],
                 "in_progress": None}

  def device_name(self) -> str:
    import torch
    return torch.cuda.get_device_name() if self.cuda else "cpu"

  def barrier(self) -> None:
    import torch.distributed as dist
    if self.cuda:
      dist.barrier(device_ids=[self.device.index])
    else:
      dist.barrier()

  def meta(self):
    import torch
    return {
        "op": "torch_async_tp",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join([sys.executable] + sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        "device_kind": self.device_name(),
        "device_count": self.w, "platform": "gpu" if self.cuda else "cpu",
        "env": {k: os.environ.get(k) for k in (
            "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
            "NVSHMEM_DISABLE_NVLS")},
        "timing": {"warmup": self.args.warmup, "rounds": self.args.rounds,
                   "iters": self.args.iters,
                   "input_sets": self.args.input_sets,
                   "stat": "CUDA events; median and min over rounds of"
                           " round_time / iters"},
        "notes": self.notes,
    }

  def elapsed(self):
    return time.perf_counter() - self.t0

  def over_budget(self) -> bool:
    """Rank 0 decides for everyone, so no rank skips a collective alone."""
    import torch.distributed as dist
    flag = [self.args.time_budget_s > 0
            and self.elapsed() > self.args.time_budget_s]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])

  def save(self, what=None):
    if self.rank != 0:
      return
    self.data["in_progress"] = what
    self.data["elapsed_s"] = self.elapsed()
    if what:
      print(f"[{self.elapsed():7.1f}s] {what}", flush=True)
    os.makedirs(self.args.out_dir, exist_ok=True)
    with open(self.json_path + ".tmp", "w") as f:
      json.dump(self.data, f, indent=1, default=str)
    os.replace(self.json_path + ".tmp", self.json_path)
    with open(self.md_path, "w") as f:
      f.write(self.markdown())

  def markdown(self):
    m = self.data["meta"]
    lines = [f"# PyTorch async-TP on {m['device_count']} x {m['device_kind']}",
             "", f"torch {m['torch']}, NCCL {m['nccl']}, {m['date']}", "",
             "ms per call, median over rounds (min); speedup over NCCL then"
             " cuBLAS.", "",
             "| op | case | W | M x K x N | matmul | comm | NCCL+mm | ideal |"
             " torch fused (x) | rel err |", "|---|" * 1 + "---|" * 9]

    def t(d):
      if not d or d.get("median_ms") is None:
        return "err" if d and d.get("error") else "-"
      return f"{d['median_ms']:.3f} ({d['min_ms']:.3f})"
    for c in self.data["cases"]:
      b = c["baselines"]
      f = c["methods"][0] if c["methods"] else {}
      sp = f.get("speedup_vs_xla")
      lines.append(
          f"| {c['op']} | {c['name']} | {c['W']} | {c['M']}x{c['K']}x{c['N']} |"
          f" {t(b.get('matmul'))} | {t(b.get('comm'))} | {t(b.get('xla'))} |"
          f" {c.get('ideal_ms') or 0:.3f} | {t(f)}"
          f" {'(%.2fx)' % sp if sp else f.get('error', '')[:120]} |"
          f" {'%.2e' % f['rel_err'] if 'rel_err' in f else '-'} |")
    for s in self.data["skipped"]:
      lines.append(f"\nskipped {s}")
    return "\n".join(lines) + "\n"

  def timed(self, label, fn, n_sets):
    """Times fn(i) on every rank; gathers the medians of all ranks."""
    import torch
    import torch.distributed as dist
    self.save(label)
    try:
      res = timing.time_torch(
          fn, num_arg_sets=n_sets, warmup=self.args.warmup,
          rounds=self.args.rounds, iters=self.args.iters,
          barrier=self.barrier)
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc(limit=3)
      res = {"error": _err(e)}
    if self.cuda:
      torch.cuda.synchronize()
    meds = [None] * self.w
    dist.all_gather_object(meds, res.get("median_ms"))
    if res.get("median_ms") is not None:
      res["median_ms_per_rank"] = meds
      res["median_ms_max_rank"] = max(v for v in meds if v is not None)
    return res


def randn(shape, seed, device):
  import torch
  g = torch.Generator(device=device)  # Per-device stream: no host copy.
  g.manual_seed(seed)
  return torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)


def has_kwarg(op, name: str) -> bool:
  try:
    return name in str(op.default._schema)
  except Exception:  # pylint: disable=broad-except
    return False


def bench_ag(b: Bench, name, m_glob, k, n_glob):
  import torch
  import torch.distributed as dist
  w, dev, r = b.w, b.device, b.rank
  m, n = m_glob // w, n_glob // w
  s = max(1, b.args.input_sets)
  a_sh = [randn((m, k), 1000 * i + r, dev) for i in range(s)]
  bs = [randn((k, n), 1000 * i + 500 + r, dev) for i in range(s)]
  # Random, not empty: the matmul-alone baseline reads it before any gather.
  a_full = [randn((m_glob, k), 1000 * i + 300, dev) for i in range(s)]
  rec = {"op": "ag", "name": name, "W": w, "M": m_glob, "K": k, "N": n_glob,
         "baselines": {}, "methods": []}
  tag = f"ag {name} W={w}"
  rec["baselines"]["matmul"] = b.timed(
      f"{tag} matmul", lambda i: torch.matmul(a_full[i], bs[i]), s)
  rec["baselines"]["comm"] = b.timed(
      f"{tag} all_gather",
      lambda i: dist.all_gather_into_tensor(a_full[i], a_sh[i]), s)

  def nccl_mm(i):
    dist.all_gather_into_tensor(a_full[i], a_sh[i])
    return torch.matmul(a_full[i], bs[i])
  rec["baselines"]["xla"] = b.timed(f"{tag} nccl+mm", nccl_mm, s)

  op = torch.ops.symm_mem.fused_all_gather_matmul
  kw = {"return_A": False} if has_kwarg(op, "return_A") else {}

  def fused(i):
    return op(a_sh[i], [bs[i]], 0, b.group_name, **kw)[1][0]
  entry = {"method": "torch", "label": "fused_all_gather_matmul"}
  try:
    b.save(f"{tag} check")
    ref = nccl_mm(0)
    ref32 = a_full[0].float() @ bs[0].float()
    out = fused(0)
    entry["rel_err"] = rel_err(out, ref32)
    entry["rel_err_vs_nccl_mm"] = rel_err(out, ref)
    entry["rel_err_nccl_mm"] = rel_err(ref, ref32)
    del ref, ref32, out
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc(limit=3)
    entry["error"] = _err(e)
  if "error" not in entry:
    entry.update(b.timed(f"{tag} fused", fused, s))
  rec["methods"].append(entry)
  return rec


def bench_rs(b: Bench, name, m_glob, k_glob, n):
  import torch
  import torch.distributed as dist
  w, dev, r = b.w, b.device, b.rank
  m, k = m_glob // w, k_glob // w
  s = max(1, b.args.input_sets)
  a = [randn((m_glob, k), 1000 * i + r, dev) for i in range(s)]
  bs = [randn((k, n), 1000 * i + 500 + r, dev) for i in range(s)]
  partial = [randn((m_glob, n), 1000 * i + 700 + r, dev) for i in range(s)]
  outs = [torch.empty((m, n), dtype=torch.bfloat16, device=dev)
          for _ in range(s)]
  rec = {"op": "rs", "name": name, "W": w, "M": m_glob, "K": k_glob, "N": n,
         "baselines": {}, "methods": []}
  tag = f"rs {name} W={w}"
  rec["baselines"]["matmul"] = b.timed(
      f"{tag} matmul", lambda i: torch.matmul(a[i], bs[i]), s)
  rec["baselines"]["comm"] = b.timed(
      f"{tag} reduce_scatter",
      lambda i: dist.reduce_scatter_tensor(outs[i], partial[i]), s)

  def mm_nccl(i):
    dist.reduce_scatter_tensor(outs[i], torch.matmul(a[i], bs[i]))
    return outs[i]
  rec["baselines"]["xla"] = b.timed(f"{tag} mm+nccl", mm_nccl, s)

  op = torch.ops.symm_mem.fused_matmul_reduce_scatter

  def fused(i):
    return op(a[i], bs[i], "sum", 0, b.group_name)
  entry = {"method": "torch", "label": "fused_matmul_reduce_scatter"}
  try:
    b.save(f"{tag} check")
    ref = mm_nccl(0).clone()
    p32 = a[0].float() @ bs[0].float()
    ref32 = torch.empty((m, n), dtype=torch.float32, device=dev)
    dist.reduce_scatter_tensor(ref32, p32)
    out = fused(0)
    entry["rel_err"] = rel_err(out, ref32)
    entry["rel_err_vs_nccl_mm"] = rel_err(out, ref)
    entry["rel_err_nccl_mm"] = rel_err(ref, ref32)
    del ref, ref32, p32, out
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc(limit=3)
    entry["error"] = _err(e)
  if "error" not in entry:
    entry.update(b.timed(f"{tag} fused", fused, s))
  rec["methods"].append(entry)
  return rec


def summarize(rec):
  bl = rec["baselines"]
  t_mm = bl.get("matmul", {}).get("median_ms")
  t_comm = bl.get("comm", {}).get("median_ms")
  t_seq = bl.get("xla", {}).get("median_ms")
  rec["ideal_ms"] = max(t_mm, t_comm) if t_mm and t_comm else None
  rec["t_seq_ms"] = t_seq
  rec["ideal_speedup"] = (t_seq / rec["ideal_ms"]
                          if t_seq and rec["ideal_ms"] else None)
  for m in rec["methods"]:
    t = m.get("median_ms")
    if t and t_seq:
      m["speedup_vs_xla"] = t_seq / t
      m["frac_ideal"] = rec["ideal_ms"] / t if rec["ideal_ms"] else None
      m["exposed_ms"] = t - t_mm if t_mm else None
  rec["torch_best"] = rec["methods"][0] if rec["methods"] else None


def main(argv=None):
  args = parse_args(argv)
  import torch
  import torch.distributed as dist
  import common  # Case list only (imports absl, no JAX).
  b = Bench(args)
  torch.backends.cuda.matmul.allow_tf32 = False  # f32 references stay f32.
  for op in args.ops:
    cases = common.build_cases(
        op, shapes_path=args.shapes, models=args.models, tokens=args.tokens,
        square=bool(args.square), extra=args.cases, tiny=bool(args.tiny))
    for c in cases:
      if b.over_budget():
        b.data["skipped"].append({"op": op, "name": c.name, "W": b.w,
                                  "reason": "time budget exceeded"})
        continue
      if c.m % b.w or (c.n if op == "ag" else c.k) % b.w:
        b.data["skipped"].append({"op": op, "name": c.name, "W": b.w,
                                  "reason": "not divisible by W"})
        continue
      try:
        fn = bench_ag if op == "ag" else bench_rs
        rec = fn(b, c.name, c.m, c.k, c.n)
        summarize(rec)
        b.data["cases"].append(rec)
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        b.data["skipped"].append({"op": op, "name": c.name, "W": b.w,
                                  "reason": _err(e)})
      if b.cuda:
        torch.cuda.empty_cache()
      b.save(None)
  b.save(None)
  if b.rank == 0:
    print(b.markdown(), flush=True)
    print(f"wrote {b.json_path}", flush=True)
  b.barrier()
  dist.destroy_process_group()


if __name__ == "__main__":
  main()
