"""Step time of a configuration from flops, memory traffic and α-β communication.

Per micro-batch on the slowest pipeline stage (the last: its layers plus the logits):

- matrix multiplications: forward flops of the stage's tokens (:meth:`ModelSpec.
  forward_flops_per_token`, Megatron-LM's counting: the full attention square) times 3 for
  forward + backward, plus one more forward of the layers under full recomputation (of the
  attention core under selective), divided by ``tp·cp``, at ``peak × matmul_efficiency``;
- element-wise work, which is memory-bound: twice the layer's activation bytes (written,
  then read) per pass, at the HBM bandwidth;
- tensor parallelism: per layer two all-reduces (sequence parallel: a reduce-scatter and an
  all-gather, the same volume) of the layer's output in the forward pass, two in the
  backward, two more when recomputing, ring cost ``2(t−1)·α + 2(t−1)/t · bytes / bw``;
- expert parallelism: per MoE layer a dispatch and a combine all-to-all in each pass;
- context parallelism: the key/value ring, ``cp − 1`` steps per pass, hidden behind the
  attention math (only the excess counts);
- pipelining: a send and a receive of the boundary activation per micro-batch and pass.

The pipeline runs ``m + (p − 1)/v`` micro-batch slots (1F1B and GPipe; interleaved with
``v`` virtual stages), so the bubble is ``(p − 1)/(m·v + p − 1)`` of the time. Data
parallelism reduces the gradients once per step (ZeRO-1/2: reduce-scatter plus the
weights' all-gather, the same volume; ZeRO-3 also gathers the weights for every
micro-batch's forward and backward). The optimizer update reads and writes the local
states once.

Two bounds: ``no_overlap`` adds everything; ``overlap`` (the estimate reported as the step
time) hides the gradient reduction behind the last micro-batch's backward pass, ZeRO-3's
gathers behind each micro-batch's compute (as Megatron-LM and FSDP do) and the context
ring behind the attention math, each in at most ``OVERLAP`` (80 %) of that compute window.
A group uses the
node's link if its devices lie in one node (devices ordered tp, cp, dp, pp), else the
network's.
"""

from __future__ import annotations

import dataclasses

from jaxdist.advise.cluster import Cluster
from jaxdist.advise.config import ParallelConfig
from jaxdist.advise.memory import activation_bytes_per_layer, stage_params, state_bytes_per_param
from jaxdist.advise.specs import ModelSpec

# Communication hidden behind compute hides in at most this share of the compute window
# (collective kernels take SMs and memory bandwidth from the math they overlap).
OVERLAP = 0.8


@dataclasses.dataclass(frozen=True)
class StepTime:
  """Seconds per step and where they go (per micro-batch parts times slots)."""

  compute_s: float          # matmuls and element-wise work of all micro-batches
  tp_comm_s: float
  ep_comm_s: float
  cp_comm_s: float          # exposed part only
  pp_comm_s: float
  bubble_s: float
  dp_comm_s: float          # the whole reduction (and ZeRO gathers)
  dp_exposed_s: float       # what the overlap bound leaves visible
  optimizer_s: float
  flops_per_device: float   # hardware flops (recomputation included)
  model_flops: float        # 6·N·T plus attention, for MFU, whole step

  @property
  def overlap_s(self) -> float:
    return (self.compute_s + self.tp_comm_s + self.ep_comm_s + self.cp_comm_s + self.pp_comm_s
            + self.bubble_s + self.dp_exposed_s + self.optimizer_s)

  @property
  def no_overlap_s(self) -> float:
    return self.overlap_s - self.dp_exposed_s + self.dp_comm_s

  def parts(self) -> dict[str, float]:
    return {"compute": self.compute_s, "tensor_parallel": self.tp_comm_s,
            "expert_parallel": self.ep_comm_s, "context_parallel": self.cp_comm_s,
            "pipeline_p2p": self.pp_comm_s, "bubble": self.bubble_s,
            "data_parallel_exposed": self.dp_exposed_s, "optimizer": self.optimizer_s}


def _ring_all_reduce(n: int, nbytes: float, link: tuple[float, float]) -> float:
  alpha, bw = link
  return 0.0 if n <= 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw


def step_time(model: ModelSpec, cluster: Cluster, config: ParallelConfig, *,
              global_batch_size: int, seq_len: int | None = None, precision: str = "bf16",
              optimizer: str = "adam") -> StepTime:
  c, kind = config, cluster.kind
  s = seq_len or model.seq_len
  if s != model.seq_len:
    model = dataclasses.replace(model, seq_len=s)
  peak = kind.peak_fp8_flops if precision == "fp8" and kind.peak_fp8_flops else kind.peak_bf16_flops
  if precision == "fp32":
    peak = peak / 2  # TF32-class rate; a stated simplification
  rate = peak * kind.matmul_efficiency
  act_bytes = 4 if precision == "fp32" else 2
  sp = c.sequence_parallel and c.tp > 1
  m, p, v, b = c.num_micro_batches(global_batch_size), c.pp, c.virtual_stages, c.micro_batch_size
  tokens_mb = b * s
  layers = model.num_layers / p
  moe_layers = model.moe_layers / p

  fwd = model.forward_flops_per_token()
  passes = 3.0 + (1.0 if c.recompute == "full" else 0.0)
  # Forward flops of the stage's layers for one micro-batch (attention's part apart).
  attention_flops = tokens_mb * fwd["attention"] / model.num_layers * layers
  layer_flops = tokens_mb * fwd["layers"] / model.num_layers * layers + attention_flops
  recompute_attention = attention_flops if c.recompute == "selective" else 0.0
  mb_flops = ((layer_flops * passes + recompute_attention + 3.0 * tokens_mb * fwd["logits"])
              / (c.tp * c.cp))
  matmul_s = mb_flops / rate
  traffic = activation_bytes_per_layer(model, b, s, tp=c.tp, cp=c.cp, sequence_parallel=sp,
                                       act_bytes=act_bytes)
  elementwise_s = 2 * traffic * layers * passes / kind.hbm_bandwidth
  compute_mb = matmul_s + elementwise_s

  boundary = act_bytes * tokens_mb / c.cp * model.hidden_size  # one layer's output
  tp_link = cluster.link(c.tp)
  tp_mb = (4 + (2 if c.recompute == "full" else 0)) * layers * _ring_all_reduce(c.tp, boundary, tp_link)
  ep_mb = 0.0
  if c.ep > 1:
    alpha, bw = cluster.link(c.tp * c.cp * c.ep)
    dispatched = boundary / (c.tp if sp else 1) * model.experts_per_token
    per = (c.ep - 1) * alpha + dispatched * (c.ep - 1) / c.ep / bw
    ep_mb = (4 + (2 if c.recompute == "full" else 0)) * moe_layers * per
  cp_mb = 0.0
  if c.cp > 1:
    alpha, bw = cluster.link(c.tp * c.cp)
    kv = 2 * act_bytes * tokens_mb / c.cp * model.kv_dim / c.tp
    ring = (c.cp - 1) * (alpha + kv / bw) * passes * layers
    attention_s = attention_flops * passes / (c.tp * c.cp) / rate
    cp_mb = max(0.0, ring - OVERLAP * attention_s)
  pp_mb = 0.0
  if p > 1:
    alpha, bw = cluster.link(c.tp * c.cp * c.dp * 2)
    pp_mb = 2 * v * (alpha + boundary / (c.tp if sp else 1) / bw)

  slot = compute_mb + tp_mb + ep_mb + cp_mb + pp_mb
  bubble_slots = (p - 1) / v
  # Gradient reduction over the data-parallel group (experts over dp / ep).
  w, g, k = state_bytes_per_param(precision, optimizer, model.hidden_size)
  dense, expert = stage_params(model, c, "last" if p > 1 else "both")
  dp_link = cluster.link(c.tp * c.cp * c.dp)
  expert_dp = max(1, c.dp // c.ep)
  ep_link = cluster.link(c.tp * c.cp * expert_dp)
  dp_s = (_ring_all_reduce(c.dp, g * dense, dp_link)
          + _ring_all_reduce(expert_dp, g * expert, ep_link))
  gathers = 0.0
  if c.zero_stage == 3:  # all-gather of the weights before each forward and backward
    gathers = m * 2 * ((c.dp - 1) / c.dp * w * dense / dp_link[1]
                       + (expert_dp - 1) / expert_dp * w * expert / ep_link[1])
  dp_exposed = (max(0.0, dp_s - OVERLAP * compute_mb * 2 / 3)
                + max(0.0, gathers - OVERLAP * m * compute_mb))
  local = (dense / (c.dp if c.zero_stage >= 1 else 1) + expert / (expert_dp if c.zero_stage >= 1 else 1))
  optimizer_s = 2 * (w + g + k) * local / kind.hbm_bandwidth

  total_tokens = global_batch_size * s
  model_flops = 3.0 * total_tokens * (fwd["layers"] + fwd["attention"] + fwd["logits"])
  hardware_flops = (total_tokens * ((fwd["layers"] + fwd["attention"]) * passes + 3.0 * fwd["logits"])
                    + (total_tokens * fwd["attention"] if c.recompute == "selective" else 0.0))
  return StepTime(compute_s=m * compute_mb, tp_comm_s=m * tp_mb, ep_comm_s=m * ep_mb,
                  cp_comm_s=m * cp_mb, pp_comm_s=m * pp_mb, bubble_s=bubble_slots * slot,
                  dp_comm_s=dp_s + gathers, dp_exposed_s=dp_exposed, optimizer_s=optimizer_s,
                  flops_per_device=hardware_flops / c.num_devices, model_flops=model_flops)
