"""ParallelConfig and the rules a configuration must keep (NeMo Auto Configurator's
validity rules, Megatron-LM's and DeepSpeed's constraints), each broken rule with its fix."""

from __future__ import annotations

import dataclasses

from jaxdist import errors
from jaxdist.advise.cluster import Cluster
from jaxdist.advise.specs import ModelSpec

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """One way to lay a training step over a cluster.

  Devices are ordered as Megatron-LM orders them: ``tp`` innermost, then ``cp``, then
  ``dp``, then ``pp`` (so tensor parallelism stays inside a node when it fits). ``ep``
  splits the experts over the data-parallel group (it must divide ``dp``).
  ``sequence_parallel`` (Korthikanti et al.) defaults to on whenever ``tp > 1``.
  """

  dp: int = 1
  tp: int = 1
  pp: int = 1
  cp: int = 1
  ep: int = 1
  zero_stage: int = 0
  micro_batch_size: int = 1
  recompute: str = "none"
  virtual_stages: int = 1
  sequence_parallel: bool | None = None
  schedule: str = "1f1b"

  def __post_init__(self):
    for field in ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "virtual_stages"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise errors.InvalidArgumentError(
            f"ParallelConfig({field}={value!r}) must be a positive integer.")
    if self.zero_stage not in (0, 1, 2, 3) or isinstance(self.zero_stage, bool):
      raise errors.InvalidArgumentError(
          f"ParallelConfig(zero_stage={self.zero_stage!r}) must be 0, 1, 2 or 3.")
    if self.recompute not in RECOMPUTE:
      raise errors.InvalidArgumentError(
          f"ParallelConfig(recompute={self.recompute!r}) must be one of {RECOMPUTE}.")
    if self.schedule not in SCHEDULES:
      raise errors.InvalidArgumentError(
          f"ParallelConfig(schedule={self.schedule!r}) must be one of {SCHEDULES}.")
    if self.sequence_parallel is None:
      object.__setattr__(self, "sequence_parallel", self.tp > 1)

  @property
  def num_devices(self) -> int:
    return self.dp * self.tp * self.pp * self.cp

  @property
  def model_parallel(self) -> int:
    return self.tp * self.pp * self.cp * self.ep

  def num_micro_batches(self, global_batch_size: int) -> int:
    """Micro-batches per pipeline (per data-parallel replica) and step."""
    return max(1, global_batch_size // (self.dp * self.micro_batch_size))

  def label(self) -> str:
    parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
    parts += [f"cp{self.cp}"] * (self.cp > 1) + [f"ep{self.ep}"] * (self.ep > 1)
    parts += [f"v{self.virtual_stages}"] * (self.virtual_stages > 1)
    return (" ".join(parts) + f" zero{self.zero_stage} mbs{self.micro_batch_size} "
            f"recompute={self.recompute}" + (" sp" if self.sequence_parallel and self.tp > 1 else ""))

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def validate(model: ModelSpec, cluster: Cluster, config: ParallelConfig, *,
             global_batch_size: int, seq_len: int | None = None,
             allow_cross_node_tp: bool = False) -> list[str]:
  """Every rule ``config`` breaks, each as ``"<rule>: <what>; <fix>"`` (empty: valid)."""
  c, s = config, seq_len or model.seq_len
  out = []
  if c.num_devices != cluster.num_devices:
    out.append(f"devices: dp*tp*pp*cp = {c.dp}*{c.tp}*{c.pp}*{c.cp} = {c.num_devices} but the "
               f"cluster has {cluster.num_devices}; use dp = {cluster.num_devices} / (tp*pp*cp)"
               + (f" = {cluster.num_devices // (c.tp * c.pp * c.cp)}"
                  if cluster.num_devices % (c.tp * c.pp * c.cp) == 0 else
                  f" with tp*pp*cp dividing {cluster.num_devices}"))
  if model.num_heads % c.tp:
    out.append(f"heads % tp: {model.num_heads} attention heads do not split over tp={c.tp}; use tp "
               f"in {[d for d in _divisors(model.num_heads) if d <= 64]}")
  elif model.num_kv_heads % c.tp and c.tp % model.num_kv_heads:
    out.append(f"kv heads % tp: {model.num_kv_heads} key/value heads neither split over nor "
               f"replicate evenly on tp={c.tp}; use a tp that divides or is a multiple of "
               f"{model.num_kv_heads}")
  if c.tp > cluster.devices_per_node and not allow_cross_node_tp:
    out.append(f"tp inside a node: tp={c.tp} spans nodes of {cluster.devices_per_node} devices "
               f"(its all-reduces would cross the network); use tp <= {cluster.devices_per_node} "
               f"or allow_cross_node_tp=True")
  if model.num_layers % (c.pp * c.virtual_stages):
    out.append(f"layers % (pp*v): {model.num_layers} layers do not split into pp*v = "
               f"{c.pp}*{c.virtual_stages} stages; use pp*v in "
               f"{[d for d in _divisors(model.num_layers) if d > 1]}")
  if global_batch_size % (c.micro_batch_size * c.dp):
    out.append(f"global batch % (mbs*dp): {global_batch_size} does not divide into micro-batches "
               f"of {c.micro_batch_size} on dp={c.dp}; use a global batch that is a multiple of "
               f"{c.micro_batch_size * c.dp}")
  if c.ep > 1:
    if not model.is_moe:
      out.append(f"ep needs experts: ep={c.ep} on a dense model; use ep=1")
    elif model.num_experts % c.ep:
      out.append(f"experts % ep: {model.num_experts} experts do not split over ep={c.ep}; use ep "
                 f"in {_divisors(model.num_experts)}")
    if c.dp % c.ep:
      out.append(f"ep divides dp: experts are spread over the data-parallel group, and ep={c.ep} "
                 f"does not divide dp={c.dp}; use ep in {_divisors(c.dp)}")
  if c.cp > 1 and c.ep > 1:
    out.append("cp and ep not both > 1 (NeMo's rule); set one of them to 1")
  if c.cp > 1 and s % (2 * c.cp):
    out.append(f"seq % (2*cp): context parallelism splits the sequence into 2*cp = {2 * c.cp} "
               f"balanced chunks and {s} does not divide; use cp in "
               f"{[d for d in (1, 2, 4, 8, 16) if s % (2 * d) == 0]}")
  if c.virtual_stages > 1:
    m = c.num_micro_batches(global_batch_size)
    if c.pp < 2:
      out.append("virtual stages need a pipeline: virtual_stages > 1 with pp=1; use "
                 "virtual_stages=1 or pp >= 2")
    elif m % c.pp:
      out.append(f"interleaved 1F1B: {m} micro-batches per step must be a multiple of pp={c.pp} "
                 f"(Megatron-LM's rule); change micro_batch_size or the global batch")
    if c.schedule != "1f1b":
      out.append("interleaving is a 1F1B schedule; use schedule='1f1b'")
  if c.zero_stage >= 2 and c.pp > 1:
    out.append(f"ZeRO-{c.zero_stage} with pipelining: gradients sharded per micro-batch do not "
               f"combine with pipeline stages (DeepSpeed refuses it); use zero_stage <= 1 with pp > 1")
  if c.tp == 1 and c.sequence_parallel:
    out.append("sequence parallelism needs tp > 1; set sequence_parallel=False")
  return out
