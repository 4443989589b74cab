"""evaluate(): one configuration's memory, fit, rule violations, step time, throughput and
cost, and the jaxdist method that runs it."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxdist import errors
from jaxdist.advise import memory as mem
from jaxdist.advise.cluster import Cluster
from jaxdist.advise.config import ParallelConfig, validate
from jaxdist.advise.specs import ModelSpec
from jaxdist.advise.timing import StepTime, step_time

GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """What :func:`evaluate` predicts for one configuration.

  Attributes:
    memory: bytes per device of the fullest stage: ``params``, ``grads``, ``optimizer``,
      ``activations``, ``workspace`` (allowance) and ``total``.
    fits: ``total`` is at most the device's memory.
    violations: the rules the configuration breaks (:func:`jaxdist.advise.validate`).
    problems: ``violations`` plus, if it does not fit, by how much and what would help.
    step_time_s: the overlap bound (see :mod:`jaxdist.advise.timing`);
      ``step_time_bounds`` is ``(overlap, no_overlap)``; ``time`` has every part.
    tokens_per_s, mfu (model flops 6·N·T plus attention over peak), tflops_per_device
      (Megatron-LM's counting: recomputation included), cost_per_million_tokens (US$).
  """

  model: ModelSpec
  cluster: Cluster
  config: ParallelConfig
  global_batch_size: int
  seq_len: int
  precision: str
  optimizer: str
  memory: dict[str, float]
  violations: list[str]
  time: StepTime

  @property
  def fits(self) -> bool:
    return self.memory["total"] <= self.cluster.kind.memory_bytes

  @property
  def valid(self) -> bool:
    return not self.violations

  @property
  def problems(self) -> list[str]:
    out = list(self.violations)
    if not self.fits:
      over = self.memory["total"] / self.cluster.kind.memory_bytes
      biggest = max(("params", "grads", "optimizer", "activations"), key=self.memory.get)
      hint = {"activations": "recompute, a smaller micro-batch, more tp/cp or sequence parallelism",
              "optimizer": "a higher ZeRO stage, or more tp/pp",
              "grads": "ZeRO-2/3, or more tp/pp",
              "params": "ZeRO-3, or more tp/pp"}[biggest]
      out.append(f"memory: {self.memory['total'] / GIB:.1f} GiB per device is {over:.2f}x the "
                 f"{self.cluster.kind.memory_bytes / GIB:.0f} GiB of {self.cluster.device} "
                 f"(largest part: {biggest}); try {hint}")
    return out

  @property
  def step_time_s(self) -> float:
    return self.time.overlap_s

  @property
  def step_time_bounds(self) -> tuple[float, float]:
    return self.time.overlap_s, self.time.no_overlap_s

  @property
  def tokens_per_s(self) -> float:
    return self.global_batch_size * self.seq_len / self.step_time_s

  @property
  def peak_flops(self) -> float:
    k = self.cluster.kind
    return k.peak_fp8_flops if self.precision == "fp8" and k.peak_fp8_flops else k.peak_bf16_flops

  @property
  def mfu(self) -> float:
    return self.time.model_flops / (self.step_time_s * self.config.num_devices * self.peak_flops)

  @property
  def tflops_per_device(self) -> float:
    return self.time.flops_per_device / self.step_time_s / 1e12

  @property
  def bubble_fraction(self) -> float:
    c = self.config
    m = c.num_micro_batches(self.global_batch_size)
    return (c.pp - 1) / (m * c.virtual_stages + c.pp - 1)

  @property
  def cost_per_million_tokens(self) -> float:
    return self.cluster.kind.price_per_hour * self.config.num_devices / 3600 / self.tokens_per_s * 1e6

  def training_days(self, tokens: float) -> float:
    """Days to train on ``tokens`` at this configuration's predicted throughput."""
    return tokens / self.tokens_per_s / 86400

  def method(self, *, layer_module: str | None = None,
             attention_module: str = "MultiHeadDotProductAttention"):
    """The jaxdist method that runs this configuration (see :mod:`jaxdist.advise.launch`)."""
    from jaxdist.advise.launch import method_for

    return method_for(self, layer_module=layer_module, attention_module=attention_module)

  def to_dict(self) -> dict[str, Any]:
    return {"model": self.model.name, "num_params": self.model.num_params,
            "device": self.cluster.device, "num_devices": self.config.num_devices,
            **self.config.to_dict(), "config": self.config.label(),
            "global_batch_size": self.global_batch_size, "seq_len": self.seq_len,
            "precision": self.precision, "optimizer": self.optimizer,
            **{f"memory_{k}_bytes": v for k, v in self.memory.items()},
            "fits": self.fits, "valid": self.valid,
            "step_time_s": self.step_time_s, "step_time_no_overlap_s": self.time.no_overlap_s,
            **{f"time_{k}_s": v for k, v in self.time.parts().items()},
            "bubble_fraction": self.bubble_fraction, "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.tflops_per_device, "mfu": self.mfu,
            "cost_per_million_tokens": self.cost_per_million_tokens,
            "problems": self.problems}

  def summary(self) -> str:
    mm = self.memory
    lines = [f"{self.model.name} on {self.config.num_devices}x {self.cluster.device}: "
             f"{self.config.label()}",
             f"  memory/device {mm['total'] / GIB:.1f} GiB of {self.cluster.kind.memory_bytes / GIB:.0f}"
             f" (params {mm['params'] / GIB:.1f}, grads {mm['grads'] / GIB:.1f}, optimizer "
             f"{mm['optimizer'] / GIB:.1f}, activations {mm['activations'] / GIB:.1f}, workspace "
             f"{mm['workspace'] / GIB:.1f}) {'fits' if self.fits else 'DOES NOT FIT'}",
             f"  step {self.step_time_s:.3f} s (no overlap {self.time.no_overlap_s:.3f} s), "
             f"{self.tokens_per_s:,.0f} tokens/s, {self.tflops_per_device:.0f} TFLOP/s per device, "
             f"MFU {100 * self.mfu:.1f}%, ${self.cost_per_million_tokens:.3f} per million tokens"]
    lines += [f"  problem: {p}" for p in self.problems]
    return "\n".join(lines)


def _check_batch(global_batch_size) -> None:
  n = global_batch_size
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise errors.InvalidArgumentError(
        f"global_batch_size={global_batch_size!r} must be a positive integer (sequences per step).")


def evaluate(model: ModelSpec, cluster: Cluster, config: ParallelConfig, *, global_batch_size: int,
             seq_len: int | None = None, precision: str = "bf16", optimizer: str = "adam",
             allow_cross_node_tp: bool = False) -> Evaluation:
  """Predict memory per device, fit and step time of ``config`` for ``model`` on ``cluster``."""
  for name, value, kind in (("model", model, ModelSpec), ("cluster", cluster, Cluster),
                            ("config", config, ParallelConfig)):
    if not isinstance(value, kind):
      raise errors.InvalidArgumentError(
          f"evaluate({name}={value!r:.60}) must be a jaxdist.advise.{kind.__name__}.")
  _check_batch(global_batch_size)
  s = seq_len or model.seq_len
  if s != model.seq_len:
    model = dataclasses.replace(model, seq_len=s)
  memory = mem.memory_per_device(model, config, global_batch_size=global_batch_size,
                                 precision=precision, optimizer=optimizer).as_dict()
  violations = validate(model, cluster, config, global_batch_size=global_batch_size,
                        allow_cross_node_tp=allow_cross_node_tp)
  if precision == "fp8" and not cluster.kind.peak_fp8_flops:
    violations.append(f"fp8: {cluster.device} has no fp8 matrix units; use precision='bf16'")
  time = step_time(model, cluster, config, global_batch_size=global_batch_size,
                   precision=precision, optimizer=optimizer)
  return Evaluation(model, cluster, config, global_batch_size, s, precision, optimizer, memory,
                    violations, time)
