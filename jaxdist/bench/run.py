"""Run suites: one row per (model, method), written to ``results.csv`` / ``results.json``.

Per row: step time mean and std over ``repeat`` steps after one warm-up step (measured
here), parameters, model flops (the traced serial step's matmuls and convolutions, forward
and backward; for GPT also Megatron-LM's formula), TFLOP/s per device and MFU against the
device kind's peak, compiled bytes per device, communication bytes per step, trace + plan +
compile seconds, the mesh or stage layout, the first step's loss against the single-device
step, and a projected step time on one H100 node from the compiled HLO:

    SPMD:      flops_per_device / reached + Σ_collectives (count·α + β·wire_bytes)
    pipeline:  (m + p − 1) · (max_stage (forward + backward flops per micro-batch) / reached
               + max_boundary 2 (α + β · activation bytes))  + the same collective term

with α = 10 µs, β = 1/450 GB/s, reached = 400 TFLOP/s (``suites.H100_NODE``); projected MFU
is against the 989 TFLOP/s peak.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import time
from pathlib import Path

import jax
import numpy as np

from jaxdist import jaxpr_util, progress
from jaxdist.bench.suites import H100_NODE, Workload, device_list, methods, workload
from jaxdist.mesh import device_costs

LOSS_RTOL = 1e-4  # first-step loss against the single-device step


@dataclasses.dataclass
class Row:
  suite: str
  model: str
  method: str
  kind: str
  status: str
  num_devices: int
  step_time_mean_s: float | None = None
  step_time_std_s: float | None = None
  params: int = 0
  model_flops: float = 0.0
  formula_flops: float | None = None
  tflops_per_device: float | None = None
  mfu: float | None = None
  bytes_per_device: int | None = None
  peak_bytes_in_use: int | None = None  # where the backend reports it (not XLA:CPU)
  comm_bytes: float | None = None
  compile_s: float | None = None  # the first call: trace + plan + lower + XLA compile
  trace_s: float | None = None
  plan_s: float | None = None
  xla_compile_s: float | None = None  # lower + XLA compile
  layout: str = ""
  loss: float | None = None
  serial_loss: float | None = None
  matches_serial: bool | None = None
  projected_h100_s: float | None = None
  projected_mfu: float | None = None
  reason: str = ""
  jax_version: str = jax.__version__
  device_kind: str = ""
  date: str = ""


COLUMNS = [f.name for f in dataclasses.fields(Row)]


def model_flops(w: Workload, state) -> float:
  """Matmul and convolution flops of one serial step (forward and backward)."""
  closed = jax.make_jaxpr(w.step)(state, w.batch)
  return float(sum(jaxpr_util.eqn_flops(e) for e in closed.jaxpr.eqns))


def projected_seconds(exe, k: int = 1) -> float:
  comm = sum(s.count * H100_NODE["alpha"] + s.wire_bytes * H100_NODE["beta"]
             for s in exe.communication().values())
  stages = getattr(exe, "stages", None)
  if stages:
    compute = max(sum(float(p.cost_analysis().get("flops", 0.0)) for p in (st.forward, st.backward))
                  for st in stages) / H100_NODE["reached_flops"]
    # Activations into a stage and their cotangents back, per micro-batch (device_puts
    # between sub-meshes, not collectives).
    transfer = max((2 * (H100_NODE["alpha"] + H100_NODE["beta"] * sum(
        math.prod(a.shape) * a.dtype.itemsize for a in st.in_avals))
        for st in stages[1:]), default=0.0)
    return (k + len(stages) - 1) * (compute + transfer) + comm
  analyses = exe.cost_analysis()  # a list for an SPMD pipeline (one program)
  analyses = analyses if isinstance(analyses, list) else [analyses]
  return sum(float(a.get("flops", 0.0)) for a in analyses) / H100_NODE["reached_flops"] + comm


def _peak_in_use(devices) -> int | None:
  """The most bytes any device has held (``memory_stats()``, since the process started),
  or None where the backend does not report it."""
  stats = [d.memory_stats() for d in devices]
  peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
  return max(peaks) if peaks else None


def _layout(exe) -> str:
  stages = getattr(exe, "stages", None)
  if stages:
    return " / ".join(f"{len(st.mesh.devices)}dev{tuple(st.mesh.shape)}" for st in stages)
  return "x".join(map(str, exe.plan.mesh_shape))


def run_method(w: Workload, name: str, kind: str, method, devices, repeat: int,
               serial_loss: float, flops: float, params: int) -> Row:
  import jaxdist as jd

  n = len(devices)
  row = Row(w.suite, w.name, name, kind, "ok", n, params=params, model_flops=flops,
            formula_flops=w.formula_flops, serial_loss=serial_loss,
            device_kind=devices[0].device_kind,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  try:
    state = w.make_state()
    start = time.perf_counter()
    exe = jd.parallelize(w.step, method=method).get_executable(state, w.batch)
    row.compile_s = time.perf_counter() - start
    state, metrics = exe(state, w.batch)
    row.loss = float(np.asarray(metrics["loss"]))
    row.matches_serial = bool(abs(row.loss - serial_loss) <= LOSS_RTOL * abs(serial_loss))
    times = []
    for _ in range(repeat):
      t = time.perf_counter()
      state, metrics = exe(state, w.batch)
      jax.block_until_ready((state, metrics))
      times.append(time.perf_counter() - t)
  except Exception as e:  # classified and reported, never raised: the suite goes on
    from jaxdist import errors

    text = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    row.status = ("skipped" if isinstance(e, errors.JaxdistError)  # does not apply here
                  else "oom" if "RESOURCE_EXHAUSTED" in text or "out of memory" in text
                  else "error")
    row.reason = text
    return row
  row.step_time_mean_s = float(np.mean(times))
  row.step_time_std_s = float(np.std(times))
  row.tflops_per_device = flops / n / row.step_time_mean_s / 1e12
  row.mfu = flops / n / row.step_time_mean_s / device_costs(devices[0])[2]
  row.bytes_per_device = int(exe.get_total_allocation_size())
  row.peak_bytes_in_use = _peak_in_use(devices)
  timings = getattr(exe, "timings", {})
  if timings:
    row.trace_s, row.plan_s = timings.get("trace_s"), timings.get("plan_s")
    row.xla_compile_s = timings.get("lower_s", 0.0) + timings.get("compile_s", 0.0)
  row.comm_bytes = float(sum(s.wire_bytes for s in exe.communication().values()))
  row.layout = _layout(exe)
  row.projected_h100_s = projected_seconds(exe, getattr(method, "num_micro_batches", 1) or 1)
  row.projected_mfu = flops / n / row.projected_h100_s / H100_NODE["peak_flops"]
  return row


def run(suites: list[str], size: str = "tiny", method_names: list[str] | None = None,
        num_devices: int | None = None, repeat: int = 3, scaling: bool = False,
        show: bool = True, tune_budget_s: float | None = None) -> list[Row]:
  """Every (model, method) row of ``suites`` at ``size``; with ``scaling``, GPT also under
  DataParallel and ShardParallel on 1, 2, 4, 8 devices; with ``tune_budget_s``, a row per
  model for the method ``jd.tune`` picks in that many seconds of its walk."""
  devices = device_list(num_devices)
  plan = []
  for suite in suites:
    w = workload(suite, size)
    chosen = [(n, k, m) for n, k, m in methods(w, devices)
              if not method_names or any(s.lower() in n.lower() for s in method_names)]
    if tune_budget_s is not None:
      chosen.append((TUNED, "auto", tune_budget_s))
    plan += [(w, devices, c) for c in chosen]
    if scaling and suite == "gpt":
      for count in (1, 2, 4, 8):
        if count <= len(jax.devices()) and count != len(devices):
          sub = device_list(count)
          plan += [(w, sub, c) for c in methods(w, sub)
                   if c[0] in ("DataParallel", "ShardParallel (ILP)")]
  rows, reference = [], {}
  with progress.bar(len(plan), "bench", show=show) as bar:
    for w, devs, (name, kind, method) in plan:
      bar.describe(f"{w.name}: {name} on {len(devs)} devices")
      if w.name not in reference:
        state = w.make_state()
        params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
        serial = float(np.asarray(jax.jit(w.step)(state, w.batch)[1]["loss"]))
        reference[w.name] = (serial, model_flops(w, state), params)
      serial, flops, params = reference[w.name]
      if name == TUNED:
        name, method = tuned(w, devs, method, repeat)
      row = run_method(w, name, kind, method, devs, repeat, serial, flops, params)
      rows.append(row)
      if show:
        _print_row(row)
      bar.advance()
  return rows


TUNED = "jd.tune's pick"


def tuned(w: Workload, devices, budget_s: float, repeat: int):
  """(row name, method) of the fastest trial of ``jd.tune``'s walk on this machine within
  ``budget_s`` seconds, its ShardParallel candidates costed as the suites' H100 mesh
  (DataParallel if nothing ran)."""
  import jaxdist as jd
  from jaxdist.bench.suites import h100_mesh

  report = jd.tune(w.step, w.make_state(), w.batch, steps=repeat, time_budget_s=budget_s,
                   progress=False, devices=h100_mesh(devices))
  best = report.best_trial
  if best is None:
    return f"{TUNED}: none ran, DataParallel", jd.DataParallel(devices=h100_mesh(devices))
  return f"{TUNED}: {best.name}", best.method


def _print_row(r: Row) -> None:
  if r.status != "ok":
    print(f"  {r.model:<12} {r.method:<26} {r.num_devices}dev  {r.status}: {r.reason[:90]}", flush=True)
    return
  print(f"  {r.model:<12} {r.method:<26} {r.num_devices}dev  {r.step_time_mean_s * 1e3:8.2f} ms "
        f"± {r.step_time_std_s * 1e3:5.2f}  {r.bytes_per_device / 2**20:7.2f} MiB  "
        f"H100 {r.projected_h100_s * 1e3:7.3f} ms  serial {'ok' if r.matches_serial else 'DIFFERS'}",
        flush=True)


def write(rows: list[Row], out: str | Path) -> tuple[Path, Path]:
  """Appends to ``out/results.csv`` and ``out/results.json``."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  csv_path, json_path = out / "results.csv", out / "results.json"
  written = rows
  if csv_path.exists():
    with open(csv_path) as f:
      header = next(csv.reader(f), [])
    if header != COLUMNS:  # written with other columns: rewrite it with today's
      written = read_csv(csv_path) + rows
      csv_path.unlink()
  new = not csv_path.exists()
  with open(csv_path, "a", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=COLUMNS)
    if new:
      writer.writeheader()
    for r in written:
      writer.writerow({k: ("" if v is None else v) for k, v in dataclasses.asdict(r).items()})
  previous = json.loads(json_path.read_text()) if json_path.exists() else []
  json_path.write_text(json.dumps(previous + [dataclasses.asdict(r) for r in rows], indent=1))
  return csv_path, json_path


def read_csv(path: str | Path) -> list[Row]:
  """Rows back with their types (the CSV's columns are :class:`Row`'s fields)."""
  types = {f.name: f.type for f in dataclasses.fields(Row)}
  rows = []
  with open(path) as f:
    for raw in csv.DictReader(f):
      values = {}
      for k, v in raw.items():
        t = str(types[k])
        if v == "":
          values[k] = None if "None" in t else ("" if "str" in t else 0)
        elif t.startswith("int"):
          values[k] = int(v)
        elif "float" in t:
          values[k] = float(v)
        elif "bool" in t:
          values[k] = v == "True"
        else:
          values[k] = v
      rows.append(Row(**values))
  return rows


def summary(rows: list[Row]) -> list[dict]:
  """Per model (on the most devices): the best hand plan, the best automatic plan and
  their ratio of projected H100 step times (goal: auto / hand <= 1.05), among the rows
  that match the serial first step."""
  out = []
  for model in dict.fromkeys(r.model for r in rows):
    # Rows whose first step differs from the serial one (a pipeline's per-micro-batch
    # BatchNorm statistics) run another computation: they do not compete.
    mine = [r for r in rows if r.model == model and r.status == "ok" and r.matches_serial]
    if not mine:
      continue
    n = max(r.num_devices for r in mine)
    mine = [r for r in mine if r.num_devices == n]
    hand = min((r for r in mine if r.kind == "hand"), key=lambda r: r.projected_h100_s, default=None)
    auto = min((r for r in mine if r.kind == "auto"), key=lambda r: r.projected_h100_s, default=None)
    ratio = (auto.projected_h100_s / hand.projected_h100_s) if hand and auto else math.nan
    out.append({"model": model, "devices": n, "best_hand": hand.method if hand else None,
                "hand_ms": hand.projected_h100_s * 1e3 if hand else None,
                "best_auto": auto.method if auto else None,
                "auto_ms": auto.projected_h100_s * 1e3 if auto else None, "ratio": ratio})
  return out


def markdown(rows: list[Row], plots: list[Path], readme: Path) -> str:
  """The table of this run and its plots, for ``bench/README.md``."""
  lines = ["# Benchmark suites", "",
           f"Latest `jaxdist bench` run on this machine ({rows[0].device_kind if rows else ''}, "
           f"{max((r.num_devices for r in rows), default=0)} devices, jax {jax.__version__}, "
           f"{rows[0].date if rows else ''}); "
           "regenerated by `make bench`. Step times are measured here (simulated CPU devices: "
           "they compare methods on this machine only); the projected H100 times come from the "
           "HLO XLA compiled for each plan (see `jaxdist/bench/run.py`). Rows append to "
           "`results/suites/results.csv` and `results.json`.", "",
           "| model | method | kind | devices | step ms (mean ± std) | MiB/device | comm KiB/step "
           "| projected H100 ms | projected MFU % | compile s | layout | matches serial |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
  for r in rows:
    if r.status != "ok":
      lines.append(f"| {r.model} | {r.method} | {r.kind} | {r.num_devices} | {r.status}: "
                   f"{r.reason[:80]} | | | | | | | |")
      continue
    lines.append(
        f"| {r.model} | {r.method} | {r.kind} | {r.num_devices} | {r.step_time_mean_s * 1e3:.2f} ± "
        f"{r.step_time_std_s * 1e3:.2f} | {r.bytes_per_device / 2**20:.2f} | "
        f"{r.comm_bytes / 1024:.1f} | {r.projected_h100_s * 1e3:.3f} | "
        f"{r.projected_mfu * 100:.2f} | {r.compile_s:.1f} | {r.layout} | "
        f"{'yes' if r.matches_serial else 'no'} |")
  if any(r.status == "ok" and r.matches_serial is False for r in rows):
    lines += ["", "A row that does not match serial ran another computation, not a wrong one: "
              "a pipeline's micro-batches compute BatchNorm statistics per micro-batch (as "
              "gradient accumulation does), so its first-step loss differs from the "
              "whole-batch serial step. Such rows are left out of the comparison below."]
  lines += ["", "Best hand plan against the automatic plan (projected H100 step time; goal ≤ 1.05):",
            "", "| model | devices | best hand plan | ms | automatic plan | ms | auto / hand |",
            "|---|---:|---|---:|---|---:|---:|"]
  for t in summary(rows):
    lines.append(f"| {t['model']} | {t['devices']} | {t['best_hand']} | {t['hand_ms']:.3f} | "
                 f"{t['best_auto']} | {t['auto_ms']:.3f} | {t['ratio']:.3f} |")
  lines.append("")
  for path in plots:
    lines.append(f"![{path.stem}]({Path(path).resolve().relative_to(readme.resolve().parent)})")
  return "\n".join(lines) + "\n"
