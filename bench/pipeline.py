"""PipeshardParallel against ShardParallel on the same 8 devices and GPT, and the pipeline
driver's host overhead per dispatched stage program.

GPT: vocab 1024, width 256, 4 blocks, seq 128, batch 32, SGD + momentum. Pipelines: the
model's own boundaries (embedding + 2 blocks | 2 blocks + head) on 2 x 4 devices, and 4
automatic layers on 4 x 2 devices, 4 micro-batches, 1F1B (the MPMD driver); and the SPMD
runtime (one program) on (4 stages, 2 data) in GPipe's and in lockstep 1F1B order and,
circular, on (2, 4) with two chunks per stage. Step times are medians of
alternating runs (the machine is noisy). On simulated CPU devices pipelining has no
bandwidth to save and every stage shares the same two cores, so this measures what the
driver costs, not what a pipeline gains on a cluster. On a GPT of width 8 (compute
negligible) it prints the driver's host time per stage program and, beside it, JAX's own
calls timed alone (a stage program's call, a copy between sub-meshes): the part of that
time no driver can remove.

Then a sweep: a GPT of 8 blocks at 4 and 8 stages x 4, 8, 16 micro-batches, on the MPMD
driver (1F1B, automatic layers) and the SPMD runtime (lockstep 1F1B), beside ShardParallel:
step time, the largest stage's peak bytes per device, the bubble measured from one step's
recorded program spans against 1F1B's, the driver's own time per program; and a picture
of one step's timeline (bench/results/pipeline_timeline.png). Run: python bench/pipeline.py
"""

import common  # noqa: F401  (device setup)

import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist import models  # noqa: E402
from jaxdist.pipeline import timeline  # noqa: E402

CONFIG = models.GPTConfig(vocab=1024, width=256, heads=8, depth=4, seq_len=128,
                          mark_boundaries=True)
BATCH = 32
ROUNDS = 12
TINY_ROUNDS = 50


def timed_step(steps, states, key, batch) -> float:
  """Runs one step of ``steps[key]`` on ``states[key]`` (which it updates); its seconds."""
  start = time.perf_counter()
  states[key], metrics = steps[key](states[key], batch)
  jax.block_until_ready(metrics)
  return time.perf_counter() - start


def main():
  batch = models.token_batch(BATCH, CONFIG)
  make = lambda: models.create_state(models.GPT(CONFIG), batch["tokens"][:, :-1],
                                     tx=optax.sgd(0.1, momentum=0.9))
  methods = {
      "ShardParallel": jd.ShardParallel(logical_mesh_shape=(8,)),
      "Pipeshard 2x4 manual": jd.PipeshardParallel(
          num_micro_batches=4, stage_option=jd.UniformStageOption(num_stages=2)),
      "Pipeshard 4x2 auto": jd.PipeshardParallel(
          num_micro_batches=4, layer_option=jd.AutoLayerOption(layer_num=4)),
      "SPMD 4x2 gpipe": jd.PipeshardParallel(
          num_micro_batches=4, pipeline_schedule="gpipe", runtime="spmd"),
      "SPMD 4x2 1f1b": jd.PipeshardParallel(
          num_micro_batches=4, pipeline_schedule="1f1b", runtime="spmd"),
      "SPMD 2x4 circular": jd.PipeshardParallel(
          num_micro_batches=4, pipeline_schedule="gpipe", runtime="spmd", virtual_stages=2,
          stage_option=jd.UniformStageOption(num_stages=4)),
  }
  steps, states = {}, {}
  for name, method in methods.items():
    states[name] = make()
    steps[name] = jd.parallelize(models.lm_step(jd.value_and_grad), method=method)
    states[name], _ = steps[name](states[name], batch)  # compile and warm up
  times = {name: [] for name in methods}
  overhead = []
  for _ in range(ROUNDS):
    for name in methods:
      times[name].append(timed_step(steps, states, name, batch))
      exe = steps[name].get_executable(states[name], batch)
      if hasattr(exe, "stages"):  # the MPMD driver's statistics of the step just run
        stats = exe.stats
        overhead.append(stats["dispatch_s"] / stats["dispatched"])
  base = statistics.median(times["ShardParallel"])
  print(f"GPT width {CONFIG.width}, {CONFIG.depth} blocks, seq {CONFIG.seq_len}, batch {BATCH}, "
        f"{jax.device_count()} devices, {ROUNDS} alternating rounds")
  print(f"{'method':<22} {'median step ms':>15} {'x ShardParallel':>16} {'collective MB/step':>19}")
  for name in methods:
    t = statistics.median(times[name])
    comm = steps[name].get_executable(states[name], batch).communication()
    wire = sum(c.wire_bytes for c in comm.values()) / 1e6
    print(f"{name:<22} {t * 1e3:>15.1f} {t / base:>16.2f} {wire:>19.1f}")
  print("(collective bytes on the wire per device, from the compiled programs; a pipeline's "
        "moves between sub-meshes are transfers, not collectives, and are not counted)")
  print(f"driver loop time per stage program on this model (it includes the compute of "
        f"programs XLA:CPU runs synchronously): "
        f"{statistics.median(overhead) * 1e3:.1f} ms")
  tiny = models.GPTConfig(vocab=16, width=8, heads=2, depth=4, seq_len=8, mark_boundaries=True)
  tiny_batch = models.token_batch(8, tiny)
  state = models.create_state(models.GPT(tiny), tiny_batch["tokens"][:, :-1], tx=optax.sgd(0.1))
  per_program, tiny_steps = [], {}
  for name in ("Pipeshard 4x2 auto", "SPMD 4x2 gpipe"):
    state = models.create_state(models.GPT(tiny), tiny_batch["tokens"][:, :-1],
                                tx=optax.sgd(0.1))
    step = jd.parallelize(models.lm_step(jd.value_and_grad), method=methods[name])
    tiny_steps[name] = []
    for _ in range(TINY_ROUNDS + 1):
      start = time.perf_counter()
      state, metrics = step(state, tiny_batch)
      jax.block_until_ready(metrics)
      tiny_steps[name].append(time.perf_counter() - start)
      exe = step.get_executable(state, tiny_batch)
      if hasattr(exe, "stages"):  # the MPMD driver
        driver, stats = exe, exe.stats
        per_program.append([stats[k] / stats["dispatched"]
                            for k in ("dispatch_s", "call_s", "move_s", "dispatch_cpu_s")])
  total, call, moves, cpu = (statistics.median(p[i] for p in per_program[1:]) * 1e6
                             for i in range(4))
  least = min(p[3] for p in per_program[1:]) * 1e6
  own = statistics.median((p[0] - p[1] - p[2]) for p in per_program[1:]) * 1e6
  print(f"driver host time per stage program (a GPT of width 8, compute negligible): "
        f"{cpu:.0f} us of CPU on the driver's thread (least {least:.0f} us; goal for the host "
        f"overhead <= 100 us: {common.verdict(cpu <= 100)}); its wall time {total:.0f} us = "
        f"{call:.0f} us inside the programs' calls + {moves:.0f} us issuing moves between "
        f"sub-meshes + {own:.0f} us of the driver's own Python (wall time counts the "
        f"programs XLA runs meanwhile on the same 2 cores)")
  call, copy, copies = jax_floor(driver)
  print(f"JAX's own calls, each timed alone with its inputs ready (median CPU): a stage "
        f"program {call:.0f} us (forward and backward averaged), a copy between sub-meshes "
        f"{copy:.0f} us, {copies:.2f} copies per stage program: {call + copies * copy:.0f} us "
        f"per stage program before any Python of the driver")
  print("the same tiny GPT's whole step: " + ", ".join(
      f"{name} {statistics.median(t[1:]) * 1e3:.2f} ms" for name, t in tiny_steps.items())
      + " (the SPMD runtime has no driver: one dispatch per step)")
  sweep()
  return True


def jax_floor(exe, rounds: int = 300) -> tuple[float, float, float]:
  """(µs of CPU per stage program call, per copy of an activation between two stages'
  sub-meshes, copies per stage program in a step) for the MPMD executable ``exe``: each
  call timed alone, its inputs placed beforehand, the median of ``rounds``."""
  def cpu_us(run):
    times = []
    for _ in range(rounds):
      start = time.thread_time()
      out = run()
      times.append(time.thread_time() - start)
      jax.block_until_ready(out)
    return statistics.median(times) * 1e6

  place = lambda avals: [jax.device_put(np.zeros(a.shape, a.dtype), a.sharding) for a in avals]
  calls, copies = [], []
  for st in exe.stages:
    ops, acts, cots = place(st.operand_avals), place(st.in_avals), place(st.cot_avals)
    index = [] if st.index_aval is None else place([st.index_aval])
    calls.append(cpu_us(lambda: st.run_forward(ops, acts, index)))
    accumulated = [st.zeros()]

    def backward():
      accumulated[0], act_cots = st.run_backward(ops, acts, cots, accumulated[0], index)
      return act_cots

    calls.append(cpu_us(backward))
  made = {v: a for st in exe.stages for v, a in zip(st.acts_out, st.out_avals)}
  for st in exe.stages:  # each activation a stage reads, from its producer's layout
    for v, a in zip(st.acts_in, st.in_avals):
      if v not in made:  # (read from before the pipeline, not from a stage)
        continue
      x = place([made[v]])[0]
      copies.append(cpu_us(lambda: jax.device_put(x, a.sharding)))
  moved = sum(len(st.acts_in) + len(st.float_in) for st in exe.stages)
  return statistics.mean(calls), statistics.median(copies), moved / (2 * len(exe.stages))


SWEEP = models.GPTConfig(vocab=1024, width=256, heads=8, depth=8, seq_len=128,
                          mark_boundaries=True)
SWEEP_ROUNDS = 5
TIMELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        "pipeline_timeline.png")


def sweep():
  """The GPT at 4 and 8 stages x 4, 8, 16 micro-batches, on the MPMD driver (1F1B) and
  the SPMD runtime (lockstep 1F1B), beside ShardParallel; one step's timeline drawn."""
  batch = models.token_batch(BATCH, SWEEP)
  make = lambda: models.create_state(models.GPT(SWEEP), batch["tokens"][:, :-1],
                                     tx=optax.sgd(0.1, momentum=0.9))
  methods = {("ShardParallel", 1, 1): jd.ShardParallel(logical_mesh_shape=(8,))}
  for p in (4, 8):
    for m in (4, 8, 16):
      methods["mpmd", p, m] = jd.PipeshardParallel(
          num_micro_batches=m, layer_option=jd.AutoLayerOption(layer_num=p), runtime="mpmd")
      methods["spmd", p, m] = jd.PipeshardParallel(
          num_micro_batches=m, runtime="spmd", pipeline_schedule="1f1b",
          stage_option=jd.UniformStageOption(num_stages=p))
  steps, states, exes, peaks = {}, {}, {}, {}
  for key, method in methods.items():
    states[key] = make()
    steps[key] = jd.parallelize(models.lm_step(jd.value_and_grad), method=method)
    states[key], _ = steps[key](states[key], batch)  # compile and warm up
    exes[key] = steps[key].get_executable(states[key], batch)
    # The busiest devices' peak (MPMD: a stage's program and what the driver keeps beside it).
    peaks[key] = exes[key].get_total_allocation_size()
  times = {key: [] for key in methods}
  driver = {key: [] for key in methods}
  for _ in range(SWEEP_ROUNDS):
    for key in methods:
      times[key].append(timed_step(steps, states, key, batch))
      if key[0] == "mpmd":  # the driver's own Python per stage program
        stats = exes[key].stats
        driver[key].append((stats["dispatch_s"] - stats["call_s"] - stats["move_s"])
                           / stats["dispatched"])
  spans = {}  # one more step of each driver, recorded (recording waits on results)
  for key in methods:
    if key[0] == "mpmd":
      exes[key].record_timeline = True
      timed_step(steps, states, key, batch)
      spans[key] = exes[key].stats["timeline"]
  base = statistics.median(times["ShardParallel", 1, 1])
  print(f"\nGPT width {SWEEP.width}, {SWEEP.depth} blocks, seq {SWEEP.seq_len}, batch {BATCH}, "
        f"{jax.device_count()} devices, {SWEEP_ROUNDS} alternating rounds; ShardParallel (8,) "
        f"{base * 1e3:.1f} ms, peak {peaks['ShardParallel', 1, 1] / 2**20:.1f} MiB per device")
  print(f"{'runtime':<8} {'stages':>6} {'micro':>6} {'step ms':>8} {'x Shard':>8} "
        f"{'peak MiB/stage':>15} {'bubble':>7} {'ideal':>6} {'driver us':>10}")
  for key in methods:
    runtime, p, m = key
    if runtime == "ShardParallel":
      continue
    t = statistics.median(times[key])
    # 1F1B's idle share with equal passes: the driver's (p-1)/(m+p-1); lockstep 2(p-1)/(m+2p-2)
    ideal = (p - 1) / (m + p - 1) if runtime == "mpmd" else 2 * (p - 1) / (m + 2 * p - 2)
    measured = f"{timeline.bubble_fraction(spans[key]):.2f}" if key in spans else "-"
    overhead = f"{statistics.median(driver[key]) * 1e6:.0f}" if driver[key] else "-"
    print(f"{runtime:<8} {p:>6} {m:>6} {t * 1e3:>8.1f} {t / base:>8.2f} "
          f"{peaks[key] / 2**20:>15.1f} {measured:>7} {ideal:>6.2f} {overhead:>10}")
  print("(peak: the largest stage's bytes per device, from XLA's compiled programs plus, on "
        "the driver, the inputs it keeps for micro-batches in flight; bubble: the driver's "
        "recorded program spans of one step, idle over all stages' time; the SPMD runtime "
        "is one program and has no spans to measure; ideal: 1F1B's with equal passes, for "
        "the SPMD runtime in lockstep; driver: the driver's own Python per stage program)")
  key = ("mpmd", 4, 8)
  os.makedirs(os.path.dirname(TIMELINE), exist_ok=True)
  timeline.draw(spans[key], TIMELINE, f"MPMD driver, 1F1B, 4 stages x 8 micro-batches, GPT width "
                f"{SWEEP.width} on {jax.device_count()} simulated CPU devices (one step)")
  print(f"timeline of one step ({key[1]} stages x {key[2]} micro-batches): {TIMELINE}")


if __name__ == "__main__":
  raise SystemExit(0 if main() else 1)
