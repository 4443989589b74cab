"""PipeshardParallel against ShardParallel on the same 8 devices and GPT, and the pipeline
driver's host overhead per dispatched stage program.

GPT: vocab 1024, width 256, 4 blocks, seq 128, batch 32, SGD + momentum. Pipelines: the
model's own boundaries (embedding + 2 blocks | 2 blocks + head) on 2 x 4 devices, and 4
automatic layers on 4 x 2 devices, 4 micro-batches, 1F1B (the MPMD driver); and the SPMD
runtime (one program) on (4 stages, 2 data) in GPipe's and in lockstep 1F1B order and,
circular, on (2, 4) with two chunks per stage. Step times are medians of
alternating runs (the machine is noisy). On simulated CPU devices pipelining has no
bandwidth to save and every stage shares the same two cores, so this measures what the
driver costs, not what a pipeline gains on a cluster. Run: python bench/pipeline.py
"""

import common  # noqa: F401  (device setup)

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist import models  # noqa: E402

CONFIG = models.GPTConfig(vocab=1024, width=256, heads=8, depth=4, seq_len=128,
                          mark_boundaries=True)
BATCH = 32
ROUNDS = 12


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
      start = time.perf_counter()
      states[name], metrics = steps[name](states[name], batch)
      jax.block_until_ready(metrics)
      times[name].append(time.perf_counter() - start)
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
    for _ in range(ROUNDS + 1):
      start = time.perf_counter()
      state, metrics = step(state, tiny_batch)
      jax.block_until_ready(metrics)
      tiny_steps[name].append(time.perf_counter() - start)
      exe = step.get_executable(state, tiny_batch)
      if hasattr(exe, "stages"):  # the MPMD driver
        stats = exe.stats
        per_program.append([stats[k] / stats["dispatched"]
                            for k in ("dispatch_s", "call_s", "move_s")])
  total, call, moves = (statistics.median(p[i] for p in per_program[1:]) * 1e6 for i in range(3))
  own = statistics.median((p[0] - p[1] - p[2]) for p in per_program[1:]) * 1e6
  print(f"driver host time per stage program (a GPT of width 8, compute negligible): "
        f"{total:.0f} us = {call:.0f} us inside the programs' calls (the runtime: dispatch, "
        f"and on XLA:CPU the run itself) + {moves:.0f} us issuing moves between sub-meshes + "
        f"{own:.0f} us of the driver's own Python (goal for the host overhead <= 100 us: "
        f"{common.verdict(total <= 100)}; the driver's own part alone: "
        f"{common.verdict(own <= 100)})")
  print("the same tiny GPT's whole step: " + ", ".join(
      f"{name} {statistics.median(t[1:]) * 1e3:.2f} ms" for name, t in tiny_steps.items())
      + " (the SPMD runtime has no driver: one dispatch per step)")
  return True


if __name__ == "__main__":
  raise SystemExit(0 if main() else 1)
