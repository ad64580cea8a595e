"""The benchmark command, run as users run it: a subprocess on CPU devices.

No benchmark code is imported here; ``benchmarks/bench.py`` runs from /tmp
so that it imports the installed ficco_jax, on 4 virtual CPU devices, with
tiny cases and two rounds.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"
TINY_OPS = ["--suite=ops", "--tiny", "--cases=128x256x256",
            "--schedules=default,none,direct/c1/dma", "--rounds=2",
            "--iters=2", "--xla_overlap=on"]


def bench(*args: str, timeout: float = 120,
          check: bool = True) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  proc = subprocess.run([sys.executable, str(BENCH), *args], cwd="/tmp",
                        env=env, capture_output=True, text=True,
                        timeout=timeout)
  if check:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


@pytest.fixture(scope="module")
def two_ops_runs(tmp_path_factory):
  """Two ops-suite results of the same cases (a before/after pair)."""
  dirs = [tmp_path_factory.mktemp(name) for name in ("before", "after")]
  for d in dirs:
    bench(*TINY_OPS, f"--out_dir={d}")
  return dirs


def test_ops_writes_results_with_provenance(two_ops_runs):
  out = two_ops_runs[0]
  data = json.loads((out / "ops.json").read_text())
  meta = data["meta"]
  assert meta["device_count"] == 4 and meta["platform"] == "cpu"
  assert "--suite=ops" in meta["command"]
  # The installed package, not the source tree.
  assert "site-packages" in meta["ficco_jax_file"]
  assert meta["env"]["JAX_PLATFORMS"] == "cpu"
  assert data["in_progress"] is None and data["axis_size"] == 4
  for key in ("ag", "rs"):
    [case] = data["ops"][key]["cases"]
    assert case["baselines"]["matmul"]["median_ms"] > 0
    assert case["baselines"]["comm"]["median_ms"] > 0
    for variant in ("shard_map", "overlap"):
      assert case["xla"][variant]["ok"], case["xla"][variant]
      assert len(case["xla"][variant]["rounds_ms"]) == 2
    assert case["xla_best"]["variant"] in ("shard_map", "overlap")
    labels = {m["label"]: m for m in case["methods"]}
    assert set(labels) == {"default", "none/c1/xla/xla", "direct/c1/dma/xla"}
    for m in labels.values():
      assert m["ok"] and m["rel_err"] < 2e-2 and m["speedup"] > 0, m
    assert labels["default"]["resolved"] == case["resolved"]
    assert case["ficco_default"]["label"] == "default"
    methods = {s["method"] for s in data["summary"][key]}
    assert {"ficco default", "ficco best"} <= methods
  md = (out / "ops.md").read_text()
  assert "## all_gather_matmul" in md and "## matmul_reduce_scatter" in md
  # The command as typed in the repository: interpreter and out_dir aside.
  assert "xla_best" in md
  # schedule=None scored against the other schedules of the run.
  assert "schedule=None against every schedule measured (1 cases)" in md
  assert "`python benchmarks/bench.py --suite=ops --tiny" in md
  assert "--out_dir" not in md and "(installed)" in md


def test_compare_pairs_every_case_and_schedule(two_ops_runs):
  before, after = two_ops_runs
  proc = bench("--suite=compare", f"--inputs={before}/ops.json,"
               f"{after}/ops.json", "--tolerance=0.5", timeout=60)
  data = json.loads((after / "compare.json").read_text())
  # 2 ops x (3 schedules) per case.
  assert len(data["rows"]) == 6
  assert {r["method"] for r in data["rows"]} == {
      "ficco default", "ficco none/c1/xla/xla", "ficco direct/c1/dma/xla"}
  assert all(r["ratio"] > 0 for r in data["rows"])
  assert "6 comparisons" in proc.stdout
  assert "Before/after" in (after / "compare.md").read_text()


def test_report_has_a_section_per_results_folder(two_ops_runs, tmp_path):
  folder = tmp_path / "cpu_w4"
  folder.mkdir()
  (folder / "ops.json").write_text((two_ops_runs[0] / "ops.json").read_text())
  out = tmp_path / "RESULTS.md"
  bench("--suite=report", f"--results_dir={tmp_path}", f"--report_out={out}",
        "--expect=nvidia_h200_w2", timeout=60)
  text = out.read_text()
  assert "## cpu, 4 GPU(s)" in text and "### Collective matmuls" in text
  assert "## NVIDIA H200, 2 GPU(s)\n\nNot yet measured" in text


def test_moe_suite_times_and_checks_the_layer(tmp_path):
  bench("--suite=moe", "--tiny", "--moe_models=qwen3-30b-a3b",
        "--moe_tokens=2048", "--routings=zipf", "--rounds=2", "--iters=2",
        "--xla_overlap=on", f"--out_dir={tmp_path}")
  data = json.loads((tmp_path / "moe.json").read_text())
  [case] = data["cases"]
  assert case["capacity"] >= case["rows_per_device"]
  assert case["piece_capacity"] <= case["capacity"]
  for name in ("ficco default", "ficco none", "ficco direct",
               "ficco none/c1/xla/pallas",
               "ficco direct/c1/xla/pallas", "xla_dense", "xla_dense_overlap"):
    r = case["programs"][name]
    assert r["ok"] and r["median_ms"] > 0, (name, r)
  # XLA at its best: the dense program compiled with the overlap options.
  assert case["programs"]["xla_dense_overlap"]["compiler_options"]
  for name in ("compute", "compute_pallas", "exchange"):
    assert case["baselines"][name]["median_ms"] > 0, name
  # XLA:CPU has no ragged all-to-all: recorded, not hidden.
  assert "ragged-all-to-all" in case["programs"]["xla_ragged"]["error"]
  assert case["xla_best"]["program"] in ("ficco none", "xla_dense",
                                         "xla_dense_overlap")
  assert "| ficco direct |" in (tmp_path / "moe.md").read_text()


def test_moe_suite_times_and_checks_the_training_pass(tmp_path):
  bench("--suite=moe", "--tiny", "--moe_models=qwen3-30b-a3b",
        "--moe_tokens=2048", "--routings=balanced", "--moe_pass=train",
        "--moe_schedules=default,none,direct", "--rounds=2", "--iters=2",
        f"--out_dir={tmp_path}")
  data = json.loads((tmp_path / "moe_train.json").read_text())
  assert data["pass"] == "train"
  [case] = data["cases"]
  for name in ("ficco default", "ficco none", "ficco direct", "xla_dense"):
    r = case["programs"][name]
    # rel_err is the worst of dx, dw1 and dw2 against the f32 gradients.
    assert r["ok"] and 0 < r["rel_err"] < 2e-2 and r["median_ms"] > 0, (
        name, r)
  assert case["baselines"]["exchange"]["median_ms"] > 0
  assert "training pass" in (tmp_path / "moe_train.md").read_text()


def test_kernel_suite_times_the_grouped_matmul(tmp_path):
  bench("--suite=kernel", "--kernel_mode=grouped", "--tiny",
        "--moe_models=mixtral-8x7b", "--grouped_rows=256", "--axis_size=2",
        "--grouped_blocks=128x128x64x4x1,ws-64x128-s4-e128-wm-gn4",
        "--grouped_zero_pass", "--grouped_runtime_sizes", "--rounds=2",
        "--iters=2", f"--out_dir={tmp_path}")
  data = json.loads((tmp_path / "kernel_grouped.json").read_text())
  assert len(data["rows"]) == 2  # Both of the layer's matmuls.
  for row in data["rows"]:
    for name in ("dense", "ragged_dot", "grouped/128x128x64x4x1",
                 "grouped/ws-64x128-s4-e128-wm-gn4",
                 "grouped (chosen) + XLA zero pass",
                 "grouped (chosen), sizes at run time"):
      t = row["times"][name]
      assert t["ok"] and t["median_ms"] > 0 and t["tflops"] > 0, (name, t)


def test_kernel_suite_times_the_grouped_weight_gradient(tmp_path):
  bench("--suite=kernel", "--kernel_mode=grouped_dw", "--tiny",
        "--moe_models=mixtral-8x7b", "--grouped_rows=256", "--axis_size=2",
        "--grouped_jitter=5", "--rounds=2", "--iters=2",
        f"--out_dir={tmp_path}")
  data = json.loads((tmp_path / "kernel_grouped_dw.json").read_text())
  assert len(data["rows"]) == 2
  for row in data["rows"]:
    assert row["group_sizes"] == [69, 59, 69, 59]
    for name in ("dense", "ragged_dot"):  # The kernel is GPU-only.
      t = row["times"][name]
      assert t["ok"] and t["median_ms"] > 0, (name, t)
  assert "The weight gradient dw" in (
      tmp_path / "kernel_grouped_dw.md").read_text()


def test_kernel_suite_refuses_a_grouped_label_it_cannot_read(tmp_path):
  proc = bench("--suite=kernel", "--kernel_mode=grouped", "--tiny",
               "--moe_models=mixtral-8x7b", "--grouped_rows=256",
               "--grouped_blocks=ws-64x128", f"--out_dir={tmp_path}",
               check=False)
  assert proc.returncode != 0
  assert "--grouped_blocks: 'ws-64x128' is not" in proc.stderr


def test_step_suite_runs_scanned_layers_forward_and_reports_throughput(
    tmp_path):
  bench("--suite=step", "--tiny", "--layers=2", "--step_mode=forward",
        "--variants=ficco,xla", "--memory_report", f"--out_dir={tmp_path}",
        timeout=240)
  data = json.loads((tmp_path / "step.json").read_text())
  assert data["sizes"]["layers"] == 2 and data["sizes"]["mode"] == "forward"
  assert data["losses_match"], data
  for name in ("ficco", "xla"):
    r = data["variants"][name]
    assert r["tokens_per_s"] > 0 and r["model_tflops_per_device"] > 0, r
    assert r["mfu"] is None  # No peak for CPUs (nor for f32).
    # XLA's report of the step program (the largest it compiled).
    assert r["memory_report"] == f"step_memory_{name}.txt", r
    report = (tmp_path / r["memory_report"]).read_text()
    assert "Total bytes:" in report and "shapes_list" in report, report
  md = (tmp_path / "step.md").read_text()
  assert "prefill (forward)" in md and "step_memory_ficco.txt" in md


def test_step_throughput_counts_tokens_devices_and_peak():
  sys.path.insert(0, str(BENCH.parent))
  from suites import step  # pylint: disable=g-import-not-at-top
  t = step.throughput(flops=8 * 494.5e12, tokens=16384, step_s=0.5,
                      num_devices=4, device_kind="NVIDIA H200",
                      dtype="bfloat16")
  assert t["tokens_per_s"] == 32768
  assert abs(t["model_tflops_per_device"] - 1978) < 1e-9
  assert abs(t["mfu"] - 1978e12 / 989e12) < 1e-12
  assert step.throughput(1e12, 1, 1.0, 1, "NVIDIA H200", "float32")["mfu"] is None
  assert step.throughput(1e12, 1, 1.0, 1, "cpu", "bfloat16")["mfu"] is None


def test_step_report_shows_each_profiled_variants_streams_not_its_timeline():
  sys.path.insert(0, str(BENCH.parent))
  from suites import step  # pylint: disable=g-import-not-at-top
  text = "\n".join([
      "## /device:GPU:0: window 2.0 ms, 1.0 ms per call (2 calls)",
      "  stream Stream #1(Compute) (compute): busy 0.9 ms/call",
      "  compute stream idle (gaps > 3 us): 0.1 ms/call",
      "  last call's timeline (us from its start; stream; dur):",
      "       0.0 Compute)   10.0  some_kernel",
      "## /device:GPU:1: window 2.0 ms, 1.0 ms per call (2 calls)",
      "  compute stream idle (gaps > 3 us): 0.2 ms/call",
      "## host threads (busiest): self time per event name",
      "  bench.py: total 5.0"])
  summary = step.profile_summary(text)
  assert "idle (gaps > 3 us): 0.1" in summary and "0.2 ms/call" in summary
  assert "some_kernel" not in summary and "bench.py" not in summary
  data = {"meta": {}, "sizes": {"mode": "train"}, "attention": "xla",
          "memory_mode": "", "variants": {
              "xla": {"schedule": "XLA", "median_ms": 1.0, "min_ms": 1.0,
                      "compile_s": 1.0, "warmup_losses": [1.0],
                      "profile": "step_profile_xla.txt",
                      "profile_summary": summary}}}
  md = step.markdown(data)
  assert "xla (whole summary: step_profile_xla.txt)" in md
  assert "0.2 ms/call" in md and "some_kernel" not in md


def _gpu_trace(streams, events):
  """A perfetto trace of GPU 0: ``streams`` {tid: thread name}, ``events``
  (tid, start us, duration us, name)."""
  meta = [{"ph": "M", "name": "process_name", "pid": 1,
           "args": {"name": "/device:GPU:0"}}]
  meta += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid,
            "args": {"name": name}} for tid, name in streams.items()]
  return meta + [{"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur,
                  "name": name} for tid, ts, dur, name in events]


def test_trace_summary_separates_exposed_collectives_from_compute():
  sys.path.insert(0, str(BENCH.parent))
  from lib import trace_summary  # pylint: disable=g-import-not-at-top
  # Stream 7 computes 0-100 and 150-250 and runs an all-gather 100-150 on
  # itself; stream 9 runs a reduce-scatter 200-500 (50 us beside compute).
  # Stream 9's 300 us would outweigh stream 7's 250 if collectives counted
  # toward picking the compute stream; they do not.
  events = _gpu_trace(
      {7: "Stream #7(Compute)", 9: "Stream #9(Compute)"},
      [(7, 0, 100, "gemm_a"), (7, 100, 50, "ncclDevKernel_AllGather_RING_LL"),
       (7, 150, 100, "gemm_b"),
       (9, 200, 300, "ncclDevKernel_ReduceScatter_Sum")])
  stats = []
  text = trace_summary.summarize(events, calls=1, timeline_events=0,
                                 stats=stats)
  assert stats == [{"gpu": "/device:GPU:0", "window": 0.5,
                    "compute_busy": 0.25, "exposed": 0.05,
                    "collectives_off": 0.3, "copies_off": 0.0,
                    "idle": 0.0}], stats
  assert "Stream #7(Compute) (compute)" in text
  assert ("collectives on the compute stream (exposed): 0.050 ms/call;"
          " off it: 0.300 ms/call, 17% of it while the compute stream ran"
          " other work") in text, text


def test_trace_summary_says_what_ended_each_compute_gap():
  sys.path.insert(0, str(BENCH.parent))
  from lib import trace_summary  # pylint: disable=g-import-not-at-top
  # gemm_b starts 4 us after the copy ends: it waited for the copy. gemm_c
  # starts 200 us after gemm_b with nothing ending near: the host. The
  # copy that ended long before gemm_c is not its cause.
  events = _gpu_trace(
      {7: "Stream #7(Compute)", 9: "Stream #9(MemcpyP2P)"},
      [(7, 0, 100, "gemm_a"), (9, 50, 146, "MemcpyP2P"),
       (7, 200, 100, "gemm_b"), (7, 500, 100, "gemm_c")])
  text = trace_summary.summarize(events, calls=1, timeline_events=0)
  lines = text.splitlines()
  i = next(k for k, l in enumerate(lines) if "gemm_a -> gemm_b" in l)
  assert ("after MemcpyP2P on Stream #9(MemcpyP2P) (1/call)"
          in lines[i + 1]), text
  i = next(k for k, l in enumerate(lines) if "gemm_b -> gemm_c" in l)
  assert "nothing else on this GPU ending just before" in lines[i + 1], text


def test_step_report_reads_the_gain_against_what_xla_left_exposed():
  sys.path.insert(0, str(BENCH.parent))
  from suites import step  # pylint: disable=g-import-not-at-top

  def stats(window, exposed, idle):
    return {"window": window, "compute_busy": 18.0, "exposed": exposed,
            "collectives_off": 2.0, "copies_off": 0.0, "idle": idle}

  # The gain is read from the traced windows, as the bound is; the timed
  # medians (here 0.5 ms apart) are not mixed in.
  data = {"xla_best": "xla", "variants": {
      "xla": {"median_ms": 21.0, "profile_stats": stats(20.0, 1.0, 2.0)},
      "ficco": {"median_ms": 20.5, "profile_stats": stats(19.0, 0.0, 1.5)}}}
  [_, line] = step._bound_lines(data)  # pylint: disable=protected-access
  assert "3.00 ms that overlap could hide at most" in line, line
  assert "1.00 ms shorter (33% of it)" in line, line
  assert "runs 0.00 ms of collectives and idles 1.50 ms" in line, line
  # Nothing exposed, no gaps: no share of zero.
  data["variants"]["xla"]["profile_stats"] = stats(20.0, 0.0, 0.0)
  [_, line] = step._bound_lines(data)  # pylint: disable=protected-access
  assert "0.00 ms that overlap could hide" in line and "% of it" not in line
  del data["variants"]["xla"]["profile_stats"]
  assert not step._bound_lines(data)  # pylint: disable=protected-access


def test_tests_suite_counts_a_run_cut_before_its_summary():
  sys.path.insert(0, str(BENCH.parent))
  from suites import tests as tests_suite  # pylint: disable=g-import-not-at-top
  cut = "\n".join([
      "..s.F.ss" + "." * 64 + " [ 40%]",
      "...sE.",
  ])
  s = tests_suite.summarize(cut)
  assert s["closing_line"] is None
  assert s["counts"] == {"passed": 4 + 64 + 4, "skipped": 4, "failed": 1,
                         "errors": 1}, s["counts"]
  md = tests_suite.markdown({"meta": {}, "pytest_command": "pytest",
                             "returncode": -2, "seconds": 9.0, "summary": s,
                             "stopped_at_limit": True})
  assert "stopped before pytest's summary" in md and "1 failed" in md
  quiet = tests_suite.markdown({"meta": {}, "pytest_command": "pytest",
                                "returncode": 1, "seconds": 9.0, "summary": s})
  assert "no summary line" in quiet and "time limit" not in quiet
  done = "\n".join([
      "..F" + " [100%]",
      "=" * 10 + " FAILURES " + "=" * 10,
      "_ test_with_a_long_id[case-one] _",
      "___________ test_short ___________",
      "=" * 5 + " 2 failed, 1 passed in 3.00s " + "=" * 5,
  ])
  s = tests_suite.summarize(done)
  assert s["counts"] == {"failed": 2, "passed": 1}
  md = tests_suite.markdown({"meta": {}, "pytest_command": "pytest",
                             "returncode": 2, "seconds": 9.0, "summary": s,
                             "time_limit_s": 8.0, "stopped_at_limit": True})
  assert "in 3.00s (stopped at its 8 s limit)" in md
  assert s["failures"] == ["FAILED test_with_a_long_id[case-one]",
                           "FAILED test_short"]


def test_case_filter_keeps_the_matching_cases_and_names_them_if_none(
    tmp_path):
  args = ["--suite=ops", "--ops=ag", "--tiny",
          "--cases=keep:128x256x256,drop:128x256x512", "--schedules=none",
          "--rounds=1", "--iters=1", f"--out_dir={tmp_path}"]
  bench(*args, "--case_filter=^keep")
  data = json.loads((tmp_path / "ops.json").read_text())
  assert [c["name"] for c in data["ops"]["ag"]["cases"]] == ["keep"]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  proc = subprocess.run([sys.executable, str(BENCH), *args,
                         "--case_filter=nothing"], cwd="/tmp", env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "matches none of the 2 cases: keep, drop" in proc.stderr + proc.stdout


def test_gpu_monitor_reads_clocks_power_and_limits():
  sys.path.insert(0, str(BENCH.parent))
  from lib import gpu_monitor  # pylint: disable=g-import-not-at-top
  lines = ["0, 1980, 650.5, 61, 0x0000000000000000",
           "0, 1755, 699.9, 66, 0x0000000000000004",
           "1, 1980, 610.0, 58, 0x0000000000000001",
           "1, [N/A], 600.0, 58, 0x0",  # No clock: skipped, not a crash.
           "index, clocks.sm [MHz], power.draw [W], ...",  # A header.
           "2, 1700, [Not Supported], 50, [N/A]"]  # Kept without power.
  s = gpu_monitor.parse(lines)
  assert s["0"]["samples"] == 2 and s["1"]["samples"] == 1
  assert s["2"]["power_w_max"] is None and s["2"]["limits"] == []
  assert gpu_monitor.describe({"2": s.pop("2")}) == "1700-1700 MHz (low 1700)"
  assert (s["0"]["sm_mhz_mean"] == (1980 + 1755) / 2
          and s["0"]["sm_mhz_min"] == 1755)
  assert s["0"]["power_w_max"] == 699.9 and s["0"]["temp_c_max"] == 66
  assert s["0"]["limits"] == ["SW power cap"] and s["1"]["limits"] == []
  text = gpu_monitor.describe(s)
  assert text == ("1868-1980 MHz (low 1755), 610-675 W (high 700),"
                  " limits: SW power cap"), text
  assert gpu_monitor.describe(None) == "n/a"
  with gpu_monitor.Monitor() as m:  # No nvidia-smi on CPU hosts: nothing.
    pass
  if shutil.which("nvidia-smi") is None:
    assert m.summary is None


def test_accuracy_scores_schedule_none_on_the_second_pass_when_there_is_one():
  sys.path.insert(0, str(BENCH.parent))
  from suites import ops_report  # pylint: disable=g-import-not-at-top

  def method(label, ms, again=None):
    m = {"method": "ficco", "label": label, "median_ms": ms, "ok": True,
         "speedup": 2.0 / ms}
    if again is not None:
      m["retime"] = {"median_ms": again}
    return m

  # First pass: "b" looks 4% faster than schedule=None (a miss); timed
  # again side by side, it is 1% faster (within 3%), and XLA at its best
  # takes 0.9 ms the second time (its program with the overlap flags; the
  # one in shard_map, 1.5 ms, alone would not say so): schedule=None is
  # more than 2% slower than XLA there.
  case = {"name": "c", "xla": {"shard_map": {"median_ms": 2.0,
                                             "retime": {"median_ms": 1.5}},
                               "overlap": {"median_ms": 2.1,
                                           "retime": {"median_ms": 0.9}}},
          "methods": [method("default", 1.04, 1.01), method("b", 1.00, 1.00),
                      method("c", 1.20)]}
  first = dict(case, methods=[dict(m) for m in case["methods"]])
  for m in first["methods"]:
    m.pop("retime", None)
  a = ops_report.accuracy([first])
  assert a["retimed"] == 0 and a["within"] == 0 and len(a["misses"]) == 1
  a = ops_report.accuracy([case])
  assert a["retimed"] == 1 and a["within"] == 1 and not a["misses"], a
  assert a["slower_than_xla"] == ["c"], a
  assert "scored on a second round-robin" in "\n".join(
      ops_report._accuracy_lines([case]))  # pylint: disable=protected-access


def test_ops_suite_times_the_fastest_schedules_again_with_retime_top(
    tmp_path):
  bench("--suite=ops", "--tiny", "--cases=128x256x256", "--ops=rs",
        "--schedules=default,none,direct/c1/dma,direct/c2/dma", "--rounds=2",
        "--iters=2", "--retime_top=1", "--xla_overlap=on",
        f"--out_dir={tmp_path}")
  c = json.loads((tmp_path / "ops.json").read_text())["ops"]["rs"]["cases"][0]
  again = {m["label"] for m in c["methods"] if m.get("retime")}
  # schedule=None and the one fastest other schedule of the first pass.
  fastest = min((m for m in c["methods"] if m["label"] != "default"),
                key=lambda m: m["median_ms"])["label"]
  assert again == {"default", fastest}, again
  assert all(m["retime"]["median_ms"] > 0 for m in c["methods"]
             if m.get("retime"))
  # Both of XLA's programs: xla_best is the faster of them in this pass too.
  assert c["xla"]["shard_map"]["retime"]["median_ms"] > 0
  assert c["xla"]["overlap"]["retime"]["median_ms"] > 0
  assert "second round-robin" in (tmp_path / "ops.md").read_text()


def test_time_chains_interleaves_stateful_programs_and_keeps_their_states():
  sys.path.insert(0, str(BENCH.parent))
  from lib import timing  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  order = []

  def chain(tag, inc):
    def step(s, x):
      order.append(tag)
      return s + inc * x
    return step, jnp.zeros(())

  states, recs = timing.time_chains(
      [chain("a", 1.0), chain("b", 10.0)], [(jnp.ones(()),)], warmup=2,
      rounds=3, iters=4)
  # Each chain: 2 warm-up calls, then per round 1 settle + 4 timed calls.
  assert order.count("a") == order.count("b") == 2 + 3 * (1 + 4)
  assert float(states[0]) == 17.0 and float(states[1]) == 170.0
  assert all(r["rounds"] == 3 and r["iters"] == 4 and r["interleaved"]
             for r in recs)
  # Interleaved: after the warm-up, the chains' blocks alternate.
  blocks = [t for i, t in enumerate(order[4:]) if i % 5 == 0]
  assert sorted(blocks[:2]) == ["a", "b"] and sorted(blocks[2:4]) == ["a", "b"]


def test_step_suite_interleaves_its_variants_in_one_process(tmp_path):
  bench("--suite=step", "--tiny", "--variants=ficco,xla",
        "--step_interleave", f"--out_dir={tmp_path}", timeout=240)
  data = json.loads((tmp_path / "step.json").read_text())
  assert data["memory_mode"].startswith("one process, the variants timed")
  assert data["losses_match"], data
  # The backward pass checked too (the training step's default mode).
  assert data["grads_match"] and not data["grads_mismatch"], data
  for name in ("ficco", "xla"):
    r = data["variants"][name]
    assert r["interleaved"] and r["median_ms"] > 0, r
    assert set(r["grad_fingerprint"]) == {"ln1", "wqkv", "wo", "ln2",
                                          "w_up", "w_down"}
  assert "step 0's gradients match XLA's" in (tmp_path / "step.md").read_text()


def test_step_gradient_check_fails_on_a_wrong_gradient():
  """What grads_match catches that the first loss cannot: the same norm in
  another direction (a misplaced block), or another norm."""
  sys.path.insert(0, str(BENCH.parent))
  from suites import step  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  g = rng.standard_normal((64, 48))
  wrong = g[::-1]  # Rows misplaced: same norm.
  proj = rng.standard_normal((step.GRAD_PROJECTIONS, 64, 48))

  def fp(a):
    return {"w": {"norm": float(np.linalg.norm(a)),
                  "projections": [float((p * a).sum()) for p in proj]}}
  assert step.grads_match(fp(g * (1 + 1e-3)), fp(g), 2e-2) is None
  assert "direction" in step.grads_match(fp(wrong), fp(g), 2e-2)
  assert "norm" in step.grads_match(fp(2 * g), fp(g), 2e-2)
  assert "no gradient" in step.grads_match({}, fp(g), 2e-2)


def test_gpu_monitor_summarises_the_ops_suites_cases():
  sys.path.insert(0, str(BENCH.parent))
  from lib import gpu_monitor  # pylint: disable=g-import-not-at-top
  a = gpu_monitor.parse(["0, 1980, 600, 60, 0x0", "1, 1900, 600, 60, 0x4"])
  b = gpu_monitor.parse(["0, 1700, 690, 70, 0x0", "1, 1750, 700, 70, 0x0"])
  assert gpu_monitor.describe_cases([a, None, b]) == (
      "2 timed blocks: mean SM clock 1700-1900 MHz (the slowest GPU of"
      " each), limits: SW power cap")
  assert gpu_monitor.describe_cases([None]) is None


def test_characterize_times_each_matmul_against_the_same_copies(tmp_path):
  bench("--suite=characterize", "--tiny", "--sections=contention",
        "--contention_p=2", "--contention_mib=1,4",
        "--contention_mm=1024x1024x1024",
        "--contention_compute=xla,pallas/sm2", "--engines=dma",
        "--rounds=2", "--iters=2", f"--out_dir={tmp_path / 'cpu_w2'}")
  data = json.loads((tmp_path / "cpu_w2" / "characterize.json").read_text())
  assert not [r for r in data["contention"] if "error" in r]
  # The copies alone once per size; the matmul alone and both per label.
  whats = [(r["what"], r["compute"]) for r in data["contention"]]
  assert whats.count(("copy_alone", "xla")) == 2
  for compute in ("xla", "pallas/sm2"):
    assert whats.count(("mm_alone", compute)) == 1
    assert whats.count(("both", compute)) == 2
  summary = data["contention_summary"]
  assert sorted((r["compute"], r["mib_per_peer"]) for r in summary) == [
      ("pallas/sm2", 1.0), ("pallas/sm2", 4.0), ("xla", 1.0), ("xla", 4.0)]
  for r in summary:
    expect = (r["mm_ms"] + r["copy_ms"] - r["both_ms"]) / min(r["mm_ms"],
                                                              r["copy_ms"])
    assert r["hidden"] == pytest.approx(expect)
  out = tmp_path / "RESULTS.md"
  bench("--suite=report", f"--results_dir={tmp_path}", f"--report_out={out}",
        "--expect=")
  text = out.read_text()
  assert "| 1024x1024x1024 | pallas/sm2 | dma | 4 |" in text, text


def test_characterize_refuses_a_compute_label_it_cannot_read(tmp_path):
  proc = bench("--suite=characterize", "--tiny", "--sections=contention",
               "--contention_compute=pallas/sm0", f"--out_dir={tmp_path}",
               check=False)
  data = json.loads((tmp_path / "characterize.json").read_text())
  assert "--contention_compute='pallas/sm0'" in data["skipped"][0]["error"], (
      data, proc.stderr[-2000:])


def test_a_run_on_an_edited_copy_is_traced_to_the_commit_of_its_files(
    tmp_path, monkeypatch):
  """A GPU host's copy of a checkout can hold newer files than its HEAD;
  the results name the commit whose files ran, by git tree id."""
  sys.path.insert(0, str(BENCH.parent))
  from lib import meta  # pylint: disable=g-import-not-at-top
  from lib import report  # pylint: disable=g-import-not-at-top
  repo = tmp_path / "repo"
  repo.mkdir()
  git = lambda *a: subprocess.run(  # noqa: E731
      ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
       *a], check=True, capture_output=True, text=True).stdout.strip()
  git("init", "-q")
  (repo / "op.py").write_text("v = 1\n")
  git("add", "-A")
  git("commit", "-q", "-m", "one")
  first = git("rev-parse", "HEAD")
  (repo / "op.py").write_text("v = 2\n")
  (repo / "new.py").write_text("w = 3\n")
  git("add", "-A")
  git("commit", "-q", "-m", "two")
  second = git("rev-parse", "HEAD")
  # The copy: HEAD at the first commit, the second's files (one untracked).
  git("checkout", "-q", first)
  (repo / "op.py").write_text("v = 2\n")
  (repo / "new.py").write_text("w = 3\n")
  monkeypatch.setattr(meta, "REPO", str(repo))
  m = {"git_commit": meta.git_commit(), "git_tree": meta.git_tree()}
  assert m["git_commit"] == first + "+dirty"
  assert m["git_tree"] == git("rev-parse", f"{second}^{{tree}}")
  # Through a scratch index: nothing staged in the checkout's own.
  assert git("diff", "--cached", "--name-only") == ""
  assert git("ls-files", "--others", "--exclude-standard") == "new.py"
  line = report.provenance(m)[1]
  assert f"commit {second} (the files that ran; the run's HEAD was" \
      f" {first}+dirty)" in line, line
  (repo / "new.py").write_text("w = 4\n")  # Files no commit holds.
  m["git_tree"] = meta.git_tree()
  assert "no commit here holds those files" in report.provenance(m)[1]


def test_ops_report_says_when_nothing_was_checked(tmp_path):
  bench("--suite=ops", "--tiny", "--cases=128x256x256", "--ops=ag",
        "--schedules=default,none", "--rounds=2", "--iters=2", "--nocheck",
        f"--out_dir={tmp_path}")
  assert "Not checked: --nocheck" in (tmp_path / "ops.md").read_text()
