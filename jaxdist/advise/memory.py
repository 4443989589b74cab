"""Bytes per device of a configuration: model states by the ZeRO paper's accounting,
activations by Korthikanti et al. (2022), the schedule's in-flight micro-batches, and a
stated allowance for workspace and fragmentation.

Model states (Rajbhandari et al. 2019): mixed precision keeps 16-bit weights (2 B) and
gradients (2 B) and the optimizer's fp32 states (Adam/AdamW: master weights, momentum,
variance, K = 12 B; SGD with momentum: 8 B; Adafactor: 4 B of master weights plus its
factored second moment, about 8/h B). ``precision="fp32"`` keeps 4 B weights and
gradients and no master copy. ZeRO-1 divides the optimizer states over the data-parallel
group, ZeRO-2 the gradients too, ZeRO-3 the weights too. Tensor parallelism divides
every layer's weights (experts over ep·tp), pipelining the layers (the embedding on the
first stage, the head on the last, both on each when tied).

Activations of one transformer layer and micro-batch, 16-bit, s sequence, b micro-batch,
h hidden, a heads, t tensor-parallel size (Korthikanti et al., Table 2): without
parallelism ``s·b·h·(34 + 5·a·s/h)``, tensor parallel ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``,
with sequence parallelism everything divided by t, selective recomputation drops the
``5·a·s/h`` attention core, full recomputation keeps ``2·s·b·h`` (divided by t with sequence
parallelism) plus one layer's full activations while it is recomputed. The same derivation
generalizes to grouped-query attention, gated (SwiGLU) MLPs, mixture-of-experts layers
(each token's ``experts_per_token`` expert activations) and no dropout (the ``llama``
family), and reduces to the paper's numbers for a GPT layer. Context parallelism divides
the sequence. The first pipeline stage holds ``min(pp, m)`` micro-batches under 1F1B
(times ``1 + (pp - 1)/(pp·v)`` interleaved; all ``m`` under GPipe); the last stage holds the
fp32 logits, ``4·s·b·V/t``.

Allowance: 1 GiB of runtime workspace (CUDA context, NCCL and cuBLAS buffers) plus 5 % of
everything else for fragmentation, plus ZeRO-3's two gathered layers (the one computing and
the one prefetched).
"""

from __future__ import annotations

import dataclasses

from jaxdist import errors
from jaxdist.advise.config import ParallelConfig
from jaxdist.advise.specs import ModelSpec

PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
OPTIMIZERS = ("adam", "adamw", "sgd", "adafactor")
WORKSPACE_BYTES = 1 << 30
FRAGMENTATION = 0.05


def state_bytes_per_param(precision: str, optimizer: str, hidden: int) -> tuple[float, float, float]:
  """(weight, gradient, optimizer) bytes per parameter."""
  if precision not in PRECISIONS:
    raise errors.InvalidArgumentError(f"precision={precision!r} must be one of {PRECISIONS}.")
  if optimizer not in OPTIMIZERS:
    raise errors.InvalidArgumentError(f"optimizer={optimizer!r} must be one of {OPTIMIZERS}.")
  mixed = precision != "fp32"
  factored = 8.0 / hidden  # Adafactor's row and column second moments, fp32
  master = 4.0 if mixed else 0.0
  opt = {"adam": 8.0, "adamw": 8.0, "sgd": 4.0, "adafactor": factored}[optimizer] + master
  return (2.0, 2.0, opt) if mixed else (4.0, 4.0, opt)


def activation_bytes_per_layer(model: ModelSpec, micro_batch_size: int, seq_len: int | None = None,
                               *, tp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none", moe: bool | None = None,
                               act_bytes: int = 2) -> float:
  """Bytes one layer keeps for the backward pass, per micro-batch and device (the
  formulas in this module's docstring). ``moe`` picks the MoE layer (default: the model's
  kind); ``act_bytes`` is the activation dtype's size (masks are one byte)."""
  s, b, h = (seq_len or model.seq_len) / cp, micro_batch_size, model.hidden_size
  if recompute == "full":
    return act_bytes * s * b * h / (tp if sequence_parallel else 1)
  moe = model.is_moe if moe is None else moe
  dropout = model.dropout
  u = act_bytes / 2  # the paper's coefficients count 2-byte values
  sbh = s * b * h
  # Kept whole on every tensor-parallel rank unless sequence parallel: both norms' inputs,
  # the attention and MLP inputs, the two dropout masks.
  whole = u * (4 + 2 + 2) * sbh + (2 * sbh if dropout else 0)
  # Split over tp: queries, keys, values, the output projection's input, the MLP inside.
  split = u * 2 * s * b * (model.q_dim + 2 * model.kv_dim + model.v_dim)
  if moe:
    f, k = model.moe_ffn_hidden_size, model.experts_per_token
    per_expert = (4 if model.family == "gpt" else 6) * s * b * f
    split += u * ((k + model.num_shared_experts) * per_expert + 2 * 2 * k * sbh)
  else:
    split += u * (4 if model.family == "gpt" else 6) * s * b * model.ffn_hidden_size
  core = 0.0
  if recompute == "none":  # softmax output (+ dropout mask and output): 5 or 2 bytes per score
    core = (u * 2 + (u * 2 + 1 if dropout else 0)) * model.num_heads * s * (seq_len or model.seq_len) * b
  if sequence_parallel:
    return (whole + split + core) / tp
  return whole + (split + core) / tp


@dataclasses.dataclass(frozen=True)
class StageMemory:
  params: float
  grads: float
  optimizer: float
  activations: float
  workspace: float

  @property
  def total(self) -> float:
    return self.params + self.grads + self.optimizer + self.activations + self.workspace

  def as_dict(self) -> dict[str, float]:
    out = dataclasses.asdict(self)
    out["total"] = self.total
    return out


def stage_params(model: ModelSpec, config: ParallelConfig, stage: str) -> tuple[float, float]:
  """(dense, expert) parameters one device of the ``"first"`` or ``"last"`` stage holds."""
  c = config
  layers = model.num_layers / c.pp
  if model.params_override is not None:
    per_layer = (model.num_params - model.embedding_params() - model.head_params()) / model.num_layers
    dense, expert = layers * per_layer, 0.0
  else:
    moe_share = model.moe_layers / model.num_layers
    dense = layers * ((1 - moe_share) * model.dense_layer_params()
                      + moe_share * model.dense_params_per_moe_layer())
    expert = layers * moe_share * model.expert_params_per_layer()
  first, last = stage in ("first", "both"), stage in ("last", "both")
  ends = model.embedding_params() if first else 0.0
  if last:  # a tied head on another stage keeps its own copy of the embedding
    ends += model.head_params() + (model.embedding_params()
                                   if model.tied_embeddings and not first else 0.0)
  return (dense + ends) / c.tp, expert / (c.tp * c.ep)


def stage_memory(model: ModelSpec, config: ParallelConfig, *, global_batch_size: int,
                 seq_len: int | None = None, precision: str = "bf16",
                 optimizer: str = "adam", stage: str = "both") -> StageMemory:
  """Bytes per device of one pipeline stage (``"first"``, ``"last"``, or ``"both"`` when
  ``pp == 1``)."""
  c, s = config, seq_len or model.seq_len
  w, g, k = state_bytes_per_param(precision, optimizer, model.hidden_size)
  dense, expert = stage_params(model, c, stage)
  expert_dp = max(1, c.dp // c.ep)

  def sharded(nbytes: float, on: bool) -> float:
    return nbytes * (dense / c.dp + expert / expert_dp) if on else nbytes * (dense + expert)

  params = sharded(w, c.zero_stage >= 3)
  grads = sharded(g, c.zero_stage >= 2)
  opt = sharded(k, c.zero_stage >= 1)

  act_bytes = 4 if precision == "fp32" else 2
  sp = c.sequence_parallel and c.tp > 1
  b, layers = c.micro_batch_size, model.num_layers / c.pp
  moe_share = model.moe_layers / model.num_layers

  def per_layer(recompute: str) -> float:
    kw = dict(tp=c.tp, cp=c.cp, sequence_parallel=sp, recompute=recompute, act_bytes=act_bytes)
    dense_layer = activation_bytes_per_layer(model, b, s, moe=False, **kw)
    if not moe_share:
      return dense_layer
    return ((1 - moe_share) * dense_layer
            + moe_share * activation_bytes_per_layer(model, b, s, moe=True, **kw))

  m = c.num_micro_batches(global_batch_size)
  first, last = stage in ("first", "both"), stage in ("last", "both")
  if c.pp == 1:
    in_flight = 1.0
  elif c.schedule == "gpipe":
    in_flight = float(m)
  elif first:
    interleaved = 1 + (c.pp - 1) / (c.pp * c.virtual_stages) if c.virtual_stages > 1 else 1
    in_flight = min(c.pp, m) * interleaved
  else:
    in_flight = 1.0
  tokens = s / c.cp * b
  held = layers * per_layer(c.recompute)
  if first:
    held += act_bytes * tokens * model.hidden_size / (c.tp if sp else 1)  # embedding output
  activations = in_flight * held
  if c.recompute == "full":
    activations += per_layer("none")  # the layer being recomputed
  if last:
    activations += 4 * tokens * model.vocab_size / c.tp  # fp32 logits for the loss
  gathered = 2 * w * (dense + expert) / layers if c.zero_stage == 3 else 0.0
  rest = params + grads + opt + activations
  workspace = WORKSPACE_BYTES + FRAGMENTATION * rest + gathered
  return StageMemory(params, grads, opt, activations, workspace)


def memory_per_device(model: ModelSpec, config: ParallelConfig, **kwargs) -> StageMemory:
  """The larger of the first and the last stage (the only stage when ``pp == 1``)."""
  if config.pp == 1:
    return stage_memory(model, config, stage="both", **kwargs)
  return max((stage_memory(model, config, stage=s, **kwargs) for s in ("first", "last")),
             key=lambda mem: mem.total)
