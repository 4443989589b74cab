"""The ILP's plan against hand-written expert plans, projected to an 8xH100 NVLink node.

Workload: a 4-block GPT (flax linen; vocab 2048, width 512, 8 heads, seq 128, batch 16,
Adam), 8 simulated devices. Every plan is compiled here; its step time is projected from
the HLO XLA actually compiled:

    t = flops_per_device / PEAK_FLOPS + Σ_collectives (α + β · wire_bytes)

(collectives counted loop-aware by jaxdist.inspect; wire bytes as documented there).
Hand plans: DataParallel, FSDP (Zero3Parallel), Megatron tensor parallelism (attention
heads and MLP column/row splits over all 8 devices, batch replicated) and DP x TP on a
(2, 4) mesh (batch over 2, Megatron over 4); the last two are given as
partition_constraints, the layout an expert writes. Then the same with a per-device memory
budget that data parallelism does not fit. Goal: the ILP plan fits the budget and is within
5% of the best hand plan that fits. Run: python bench/compare_hand.py
"""

import common  # noqa: F401  (device setup)

import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist import inspect as hlo  # noqa: E402
from jaxdist import models  # noqa: E402

PEAK_FLOPS = 400e12          # H100 SXM, dense bf16/tf32-class throughput actually reached
ALPHA_S = 3e-6               # NVLink collective launch latency
BETA_S_PER_BYTE = 1 / 300e9  # ~300 GB/s achieved NVLink bus bandwidth per GPU
CONFIG = models.GPTConfig(vocab=2048, width=512, heads=8, depth=4, seq_len=128)
BATCH = 16


def megatron(tp_axis):
  """Megatron-LM's layout: q/k/v split by head, out projection by head (row), MLP
  first layer by column and second by row; everything else replicated."""
  attn = "state.params*['MultiHeadDotProductAttention_0']"
  return {
      attn + "['query']['kernel']": P(None, tp_axis), attn + "['key']['kernel']": P(None, tp_axis),
      attn + "['value']['kernel']": P(None, tp_axis), attn + "['query']['bias']": P(tp_axis),
      attn + "['key']['bias']": P(tp_axis), attn + "['value']['bias']": P(tp_axis),
      attn + "['out']['kernel']": P(tp_axis),
      "state.params*['block_?']['Dense_0']['kernel']": P(None, tp_axis),
      "state.params*['block_?']['Dense_0']['bias']": P(tp_axis),
      "state.params*['block_?']['Dense_1']['kernel']": P(tp_axis),
  }


def projected_seconds(exe) -> float:
  flops = float(exe.cost_analysis().get("flops", 0.0))
  comm = sum(c.multiplicity * (ALPHA_S + BETA_S_PER_BYTE * c.wire_bytes)
             for c in hlo.parse_collectives(exe.get_hlo_text())[0] if c.group_size > 1)
  return flops / PEAK_FLOPS + comm


def plans(budget):
  mesh = jd.LogicalMesh((8,), alpha=ALPHA_S, beta=BETA_S_PER_BYTE)
  option = lambda **kw: jd.AutoShardingOption(memory_budget_per_device=budget, **kw)
  yield "DataParallel", jd.DataParallel()
  yield "FSDP (Zero3)", jd.Zero3Parallel()
  yield "Megatron TP x8", jd.ShardParallel(
      devices=mesh, logical_mesh_shape=(8,),
      auto_sharding_option=jd.AutoShardingOption(partition_constraints={
          **megatron("mesh_0"), "batch*": P()}))
  yield "DP2 x TP4", jd.ShardParallel(
      devices=mesh, logical_mesh_shape=(2, 4),
      auto_sharding_option=jd.AutoShardingOption(partition_constraints={
          **megatron("mesh_1"), "batch*": P("mesh_0")}))
  yield "ILP (jaxdist)", jd.ShardParallel(devices=mesh, auto_sharding_option=option())


def run(state, batch, budget):
  rows = []
  for name, method in plans(budget):
    exe = jd.parallelize(models.lm_step(), method=method).get_executable(state, batch)
    rows.append((name, projected_seconds(exe), exe.get_total_allocation_size(),
                 exe.plan.mesh_shape))
  return rows


def main():
  batch = models.token_batch(BATCH, CONFIG)
  state = models.create_state(models.GPT(CONFIG), batch["tokens"][:, :-1], tx=optax.adam(1e-3))
  ok = True
  dp_bytes = None
  for title, budget_fn in (("no memory budget", lambda: None),
                           ("budget = 0.7 x DataParallel's bytes", lambda: 0.7 * dp_bytes)):
    budget = budget_fn()
    rows = run(state, batch, budget)
    dp_bytes = dp_bytes or rows[0][2]
    print(f"\n{title}" + (f" ({budget / 1e6:.1f} MB/device)" if budget else ""))
    print(f"{'plan':<16} {'mesh':<8} {'projected ms':>12} {'MB/device':>10} {'fits':>5}")
    fits = lambda r: budget is None or r[2] <= budget
    for name, seconds, nbytes, mesh in rows:
      print(f"{name:<16} {str(mesh):<8} {seconds * 1e3:>12.3f} {nbytes / 1e6:>10.2f} "
            f"{'yes' if fits((name, seconds, nbytes)) else 'no':>5}")
    hand = [r for r in rows[:-1] if fits(r)]
    ilp = rows[-1]
    best = min(hand, key=lambda r: r[1])
    ratio = ilp[1] / best[1]
    good = fits(ilp) and ratio <= 1.05
    ok &= good
    print(f"ILP / best fitting hand plan ({best[0]}): {ratio:.3f}; ILP fits: "
          f"{'yes' if fits(ilp) else 'no'}  (goal: fits and <= 1.05: {common.verdict(good)})")
  return ok


if __name__ == "__main__":
  raise SystemExit(0 if main() else 1)
