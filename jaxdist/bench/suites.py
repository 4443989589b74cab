"""The benchmark suites: model families at named sizes, and the methods each is run under
(hand-written expert plans and the automatic ones).

Sizes ``tiny`` and ``small`` run on 8 simulated CPU devices; ``paper-<name>`` are Alpa's
benchmark configurations of each family (GPT: seq 1024, vocab 51200; MoE: vocab 32000,
experts in every other block; Wide-ResNet: 224x224 images, bottleneck ResNet-50/101;
``jaxdist bench --suite moe --size paper-1.3B`` on real GPUs). Every method's mesh carries the costs of one H100 node
(``H100_NODE``), the target the projected step times are computed for, so that the
planner optimizes for what is projected.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax

from jaxdist import models
from jaxdist.mesh import DEVICE_COSTS

# One H100 SXM node: NVLink α/β and the dense bf16 peak of jaxdist.mesh.DEVICE_COSTS, and
# the rate large matmuls reach in practice.
_ALPHA, _BETA, _PEAK = DEVICE_COSTS["h100"]
H100_NODE = {"alpha": _ALPHA, "beta": _BETA, "reached_flops": 400e12, "peak_flops": _PEAK}

# Alpa's GPT benchmark sizes (benchmark/alpa/suite_auto_gpt.py): seq, hidden, layers, heads.
GPT_PAPER = {"125M": (1024, 768, 12, 12), "350M": (1024, 1024, 24, 16),
             "760M": (1024, 1536, 24, 16), "1.3B": (1024, 2048, 24, 32),
             "2.6B": (1024, 2560, 32, 32), "6.7B": (1024, 4096, 32, 32),
             "15B": (1024, 5120, 48, 40), "39B": (1024, 8192, 48, 64)}
# Alpa's MoE sizes (benchmark/alpa/suite_manual_moe.py): seq, hidden, layers, heads, vocab,
# experts. As in Alpa's model, every other block's MLP is the mixture and MLPs are 8x the
# width; a batch row is a dispatch group (Alpa: groups of 2048 tokens). The output layer is
# not tied to the embedding here (Alpa's names count it tied).
MOE_PAPER = {"380M": (1024, 768, 8, 16, 32000, 8), "690M": (1024, 768, 8, 16, 32000, 16),
             "1.3B": (1024, 768, 16, 16, 32000, 16), "2.4B": (1024, 1024, 16, 16, 32000, 16),
             "7.1B": (1024, 1280, 16, 16, 32000, 32), "10B": (1024, 1536, 16, 16, 32000, 32),
             "27B": (1024, 2048, 16, 16, 32000, 48), "70B": (1024, 2048, 32, 16, 32000, 64),
             "140B": (1024, 2048, 32, 16, 32000, 128)}
# Alpa's Wide-ResNet sizes (benchmark/alpa/suite_wresnet.py): image size, depth (50 or
# 101: bottleneck stages 3-4-6-3 or 3-4-23-3), base channels, width factor; 1024 classes.
WRESNET_PAPER = {"250M": (224, 50, 160, 2), "500M": (224, 50, 224, 2), "1B": (224, 50, 320, 2),
                 "2B": (224, 50, 448, 2), "4B": (224, 50, 640, 2), "6.8B": (224, 50, 320, 16),
                 "13B": (224, 101, 320, 16)}
RESNET_STAGES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}
PAPER_BATCH = 8  # per step at paper sizes (a real cluster's run sets its own)
SUITES = ("gpt", "moe", "wresnet")


@dataclasses.dataclass
class Workload:
  """One model at one size: its single-device step (with ``jd.value_and_grad``), state
  and batch makers, and what the rows report about it."""

  suite: str
  size: str
  name: str
  step: Callable
  make_state: Callable[[], Any]
  batch: Any
  formula_flops: float | None = None  # Megatron-LM's count, GPT only
  layers: int = 2
  model_parallel_dim: int = 0  # what a hand plan splits: attention heads, or experts (MoE)


def gpt_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
  """Training flops per step of a GPT without recomputation (Narayanan et al. 2021,
  eq. 3 with 3 passes instead of 4): ``72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h))``, the
  attention square counted whole."""
  return 72.0 * batch * seq * layers * hidden ** 2 * (
      1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def workload(suite: str, size: str) -> Workload:
  import jaxdist as jd
  import optax

  if suite in ("gpt", "moe"):
    experts, moe_every = 8, 1
    if size.startswith("paper-"):
      if size[6:] not in (GPT_PAPER if suite == "gpt" else MOE_PAPER):
        raise _size_error(suite, size)
      if suite == "gpt":
        (seq, hidden, layers, heads), vocab = GPT_PAPER[size[6:]], 51200
      else:
        seq, hidden, layers, heads, vocab, experts = MOE_PAPER[size[6:]]
        moe_every = 2
      config, batch_size = models.GPTConfig(
          vocab=vocab, width=hidden, heads=heads, depth=layers, seq_len=seq,
          mlp_ratio=4 if suite == "gpt" else 8), PAPER_BATCH
    elif size == "tiny":
      config, batch_size = models.GPTConfig(vocab=256, width=64, heads=4, depth=2, seq_len=32), 16
    elif size == "small":
      config, batch_size = models.GPTConfig(vocab=2048, width=256, heads=8, depth=4,
                                            seq_len=128), 16
    else:
      raise _size_error(suite, size)
    model = (models.GPT(config) if suite == "gpt" else
             models.MoELM(config, num_experts=experts, moe_every=moe_every))
    batch = models.token_batch(batch_size, config)
    flops = (gpt_flops(batch_size, config.seq_len, config.depth, config.width, config.vocab)
             if suite == "gpt" else None)
    return Workload(suite, size, f"{suite}-{size}", models.lm_step(jd.value_and_grad),
                    lambda: models.create_state(model, batch["tokens"][:, :-1],
                                                tx=optax.adam(1e-3)),
                    batch, flops, config.depth, config.heads if suite == "gpt" else experts)
  if suite == "wresnet":
    from jaxdist.bench import wresnet

    configs = {"tiny": (wresnet.WResNetConfig(image_size=16, base_width=8, width_factor=2), 16),
               "small": (wresnet.WResNetConfig(image_size=32, base_width=16, width_factor=4,
                                               blocks_per_stage=(2, 2, 2)), 32)}
    for name, (image, depth, channels, width) in WRESNET_PAPER.items():
      configs[f"paper-{name}"] = (wresnet.WResNetConfig(
          image_size=image, num_classes=1024, base_width=channels, width_factor=width,
          blocks_per_stage=RESNET_STAGES[depth], bottleneck=True), PAPER_BATCH)
    if size not in configs:
      raise _size_error(suite, size)
    config, batch_size = configs[size]
    return Workload(suite, size, f"wresnet-{size}", wresnet.train_step(jd.value_and_grad),
                    lambda: wresnet.create_state(config), wresnet.batch(batch_size, config),
                    None, sum(config.blocks_per_stage))
  raise _size_error(suite, size)


def _size_error(suite, size):
  from jaxdist import errors

  valid = {"gpt": ["tiny", "small"] + [f"paper-{k}" for k in GPT_PAPER],
           "moe": ["tiny", "small"] + [f"paper-{k}" for k in MOE_PAPER],
           "wresnet": ["tiny", "small"] + [f"paper-{k}" for k in WRESNET_PAPER]}
  if suite not in valid:
    return errors.InvalidArgumentError(f"suite={suite!r} is not a suite; valid: {SUITES}.")
  return errors.InvalidArgumentError(
      f"size={size!r} is not a size of the {suite} suite; valid: {', '.join(valid[suite])}.")


def h100_mesh(devices: list):
  """The devices as a 1-D logical mesh with an H100 node's link costs and reached flops
  (what every method of the suites plans with)."""
  import jaxdist as jd

  return jd.LogicalMesh((len(devices),), alpha=H100_NODE["alpha"], beta=H100_NODE["beta"],
                        peak_flops=H100_NODE["reached_flops"], devices=tuple(devices))


def methods(w: Workload, devices: list) -> list[tuple[str, str, Any]]:
  """(name, "hand" | "auto", method) for a workload on ``devices``."""
  import jaxdist as jd
  from jaxdist.tune.presets import load_presets

  n = len(devices)
  costs = dict(alpha=H100_NODE["alpha"], beta=H100_NODE["beta"],
               peak_flops=H100_NODE["reached_flops"], devices=tuple(devices))
  flat = h100_mesh(devices)
  out = [("DataParallel", "hand", jd.DataParallel(devices=flat)),
         ("ZeRO-2", "hand", jd.Zero2Parallel(devices=flat)),
         ("ZeRO-3 (FSDP)", "hand", jd.Zero3Parallel(devices=flat))]
  presets = {p.name: p for p in load_presets()}
  preset = {"gpt": "megatron_attention", "moe": "expert_parallel"}.get(w.suite)
  if preset and n >= 4:
    p = presets[preset]
    # Model-parallel degrees that split the heads (experts) evenly: a GPT with 12 heads
    # on 8 devices gets DP2 x TP4 only.
    degrees = [t for t in (n, n // 2) if w.model_parallel_dim % t == 0]
    if not degrees and math.gcd(n, w.model_parallel_dim) > 1:
      degrees = [math.gcd(n, w.model_parallel_dim)]
    for shape in ((n // t, t) for t in degrees):
      mesh = jd.LogicalMesh(shape, axis_names=p.axis_names, **costs)
      label = {"megatron_attention": "Megatron TP", "expert_parallel": "expert parallel"}[preset]
      name = f"{label} {shape[1]}" if shape[0] == 1 else f"DP{shape[0]} x {label} {shape[1]}"
      out.append((name, "hand", jd.ShardParallel(devices=mesh, auto_sharding_option=
                  jd.AutoShardingOption(partition_constraints=p.constraints,
                                        force_batch_dim_to_mesh_dim=0))))
  if n >= 2:
    out.append(("pipeline 2 stages", "hand", jd.PipeshardParallel(
        devices=flat, num_micro_batches=4, layer_option=jd.AutoLayerOption(layer_num=2),
        stage_option=jd.UniformStageOption(num_stages=2))))
  out.append(("ShardParallel (ILP)", "auto", jd.ShardParallel(
      devices=flat, logical_mesh_shape="search" if n > 1 else None)))
  if n >= 2:
    out.append(("PipeshardParallel (auto)", "auto", jd.PipeshardParallel(
        devices=flat, num_micro_batches=4, layer_option=jd.AutoLayerOption(layer_num=2 * w.layers),
        stage_option="auto")))
  return out


def device_list(n: int | None) -> list:
  devices = jax.devices()
  return devices if n is None else devices[:n]
