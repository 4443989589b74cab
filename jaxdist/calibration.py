"""Fitting the step-time estimate to the present devices: ``jaxdist.calibrate``.

An estimate's compute time is ``overhead + flops · seconds_per_flop + bytes ·
seconds_per_byte + kernels · seconds_per_kernel`` (flops of dots and convolutions, bytes
its buffers write and the state it reads, the buffers it writes: see
``jaxdist.estimate``). Without a profile the two rates are the device kind's peak flops
and memory bandwidth, which real steps never reach, and kernels cost nothing. The kernel
term is what a step of many small ops is made of: an encoder-decoder with [4, 12, 64]
activations per device, 623 written buffers, ran 52 ms per step on 8 simulated CPU
devices, estimated 10.4 ms by flops and bytes alone (46.5 ms with the term). It is
not a launch cost: with 2 and 4 micro-batches, each running every kernel on its part of
the batch, that step took 46.2 and 48.4 ms under ShardParallel (43.9 ms without), so
an estimate counts the kernels of one micro-batch's program once per step. A profile
measures a few reference steps (the MLP and GPT of ``jaxdist.models`` at a few sizes,
DataParallel over the devices), and fits the four coefficients (non-negative least
squares on the measured time less the estimated communication, each step weighted by
the inverse of its time: the fit minimizes relative errors, so a 16 ms step counts as
much as a 600 ms one; unweighted, the slowest steps decided the fit and the fastest were
estimated 2x too slow on this CPU). The reference steps take their gradients with
``jaxdist.value_and_grad``, so DataParallel runs them as the estimate models every
SPMD method: one program per device and one explicit reduction of the gradients. A
step whose gradient jaxdist does not see (``jaxdist.grad``) is partitioned by XLA
instead, which all-reduces each weight gradient before its transpose and then reads it
transposed in every fusion of the update: on 8 simulated CPU devices that made an
8-layer Adam MLP's step 1.9x slower (57 vs 31 ms) at the same flops and bytes, and its
references no line could fit.

A profile also measures the links: a chain of dependent all-reduces over all the
devices, of 4 bytes and of 4 MiB per device, gives the latency α of one collective and
the seconds per byte β (as the cost model charges an all-reduce: ``α + 2β(n-1)/n ·
bytes``). Estimates on a mesh at its device kind's default costs use them for the
communication time (on 8 simulated CPU devices α is ~0.2 ms and β ~1 ns/byte, where the
CPU defaults, a stand-in for a fast link, say 0.1 µs and 0.01 ns/byte).

A profile also measures what the devices lose waiting for each other at collectives.
Four of the reference models also run under Zero2Parallel, each timed in the same
rounds as its DataParallel run: beyond the fitted change in compute and the links' α/β
time, ZeRO-2's extra time over its compute is the share of the compute a step loses at
its collectives (the median over models and rounds; estimates add
``min(sync_fraction · compute, collectives · sync_cap_s)`` to the communication time). The
cap, what one collective costs at most, comes from chains of 512-wide matrix products
on every device with and without a 4-byte all-reduce after each (raised, if need be, to
the waits per collective the share gives the ZeRO-2 references: on 2 devices the chains
measured none). The share used to come from such chains too, timed one after the other:
one profile said 0.04 where ZeRO's own steps lost 0.2-0.5 of their compute (a GPT's
ZeRO-3 step was estimated at 0.75x).

Profiles live under ``$JAXDIST_CACHE_DIR/profiles`` (default ``~/.cache/jaxdist``), one
JSON file per platform, device kind and device count, like nnScaler's ``profile_dir``;
estimates use the one matching their devices and say so in their notes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import re
from pathlib import Path

import numpy as np

from jaxdist import cache_dir

VERSION = 6  # 3: reference steps with jaxdist.value_and_grad; 4: sync costs; 5: sync share
# fitted; 6: a cost per kernel
# The references also run under Zero2Parallel (their many collectives give the sync share).
SYNC_REFERENCES = ("mlp-256x16", "mlp-512x8", "gpt-128x2", "gpt-256x2")
log = logging.getLogger("jaxdist.estimate")


@dataclasses.dataclass(frozen=True)
class Profile:
  """Fitted compute-time coefficients for one platform, device kind and device count.

  Attributes:
    seconds_per_flop, seconds_per_byte, overhead_s, seconds_per_kernel: the fitted
      coefficients.
    points: per reference step, its name, measured and fitted seconds.
    created: when it was measured (ISO date and time, UTC).
    path: where it is stored.
    alpha_s, beta_s_per_byte: the measured link costs (None: not measured).
    sync_fraction, sync_cap_s: the share of the compute since the previous collective
      that a collective costs beyond α, and its most per collective (None: not measured).
  """

  platform: str
  device_kind: str
  num_devices: int
  seconds_per_flop: float
  seconds_per_byte: float
  overhead_s: float
  points: tuple[tuple[str, float, float], ...]
  created: str
  jax_version: str
  path: str = ""
  alpha_s: float | None = None
  beta_s_per_byte: float | None = None
  sync_fraction: float | None = None
  sync_cap_s: float | None = None
  seconds_per_kernel: float = 0.0

  def compute_seconds(self, flops: float, nbytes: float, kernels: float = 0.0) -> float:
    return (self.overhead_s + flops * self.seconds_per_flop + nbytes * self.seconds_per_byte
            + kernels * self.seconds_per_kernel)

  def sync_seconds(self, compute_s: float, collectives: float) -> float:
    return sync_seconds(self.sync_fraction, self.sync_cap_s, compute_s, collectives)


def sync_seconds(fraction, cap, compute_s: float, collectives: float) -> float:
  """What a step with ``collectives`` collectives spread over ``compute_s`` seconds of
  compute loses waiting at them (0 where not measured)."""
  if not fraction or not collectives:
    return 0.0
  return min(fraction * compute_s, collectives * (cap or 0.0))


def profile_path(devices) -> Path:
  d = devices[0]
  kind = re.sub(r"[^a-z0-9]+", "-", str(getattr(d, "device_kind", "")).lower()).strip("-")
  return cache_dir.root() / "profiles" / f"{d.platform}-{kind or 'unknown'}-{len(devices)}.json"


def load(devices) -> Profile | None:
  """The stored profile of these devices, or None."""
  path = profile_path(devices)
  try:
    data = json.loads(path.read_text())
    if data.pop("version") != VERSION:
      return None
    data["points"] = tuple(tuple(p) for p in data["points"])
    return Profile(**data, path=str(path))
  except (OSError, ValueError, KeyError, TypeError):
    return None


def calibrate(devices=None, *, re_profile: bool = False, steps: int = 5,
              rounds: int = 3) -> Profile:
  """Measures reference steps on ``devices`` (default all) and stores the fitted profile.

  Args:
    devices: the devices the estimates are for (a list; default ``jax.devices()``).
    re_profile: measure again even if a profile exists.
    steps: timed steps per reference step and round (the median is used).
    rounds: rounds over all reference steps; each one's time is the median of its
      rounds' medians.

  Returns:
    The profile (loaded, if one exists and ``re_profile`` is False).
  """
  import jax

  devices = list(devices or jax.devices())
  if not re_profile:
    found = load(devices)
    if found is not None:
      return found
  profile, _ = measure(devices, steps, rounds)
  store(profile)
  return profile


def measure(devices, steps: int = 5, rounds: int = 3,
            alongside=()) -> tuple[Profile, list[float]]:
  """The profile of ``devices`` (not stored), and the median seconds of each
  ``(step, *args)`` of ``alongside`` (``state, out = step(state, *args)``), timed in the
  same rounds as the reference steps: a benchmark's rows measured so, a machine whose
  speed drifts over minutes moves them and the fit alike."""
  import jax
  import optax

  from jaxdist import methods as m
  from jaxdist import models
  from jaxdist.api import parallelize
  from jaxdist.estimate import communication_seconds, estimate
  from jaxdist.measure import round_times
  from jaxdist.mesh import LogicalMesh

  n = len(devices)
  alpha, beta = _link_costs(devices, steps, rounds) if n > 1 else (None, None)
  cap = _sync_cap(devices, steps, rounds, alpha) if n > 1 else None
  links = LogicalMesh((n,), alpha=alpha, beta=beta, devices=tuple(devices)) if n > 1 else None
  references = []
  for name, (step, state, batch) in _reference_steps(n, models, optax):
    kinds = [m.DataParallel] + ([m.Zero2Parallel] if n > 1 and name in SYNC_REFERENCES else [])
    for kind in kinds:
      method = kind(devices=devices)
      est = estimate(step, state, batch, method=method, calibrated=False)
      communication = est.communication_s if links is None else communication_seconds(
          est.collectives, links)
      references.append((name, est, communication, parallelize(step, method=method), state,
                         batch))
  # Rounds over all references: one reference measured through a slow spell (seconds
  # long on shared cores) would bend every coefficient of the fit. A reference's ZeRO-2
  # run is timed next to its DataParallel one: their difference gives the waits.
  runs = [(f, state, batch) for *_, f, state, batch in references]
  per_round = round_times(runs + list(alongside), rounds, steps)
  measured = list(zip(references, per_round))
  plain = [(r, float(np.median(t))) for r, t in measured if r[1].method == "DataParallel"]
  # The fit without waits gives the waits' share; then the fit of the references less theirs.
  fraction = _sync_fraction(_fit([(r[1], t - r[2]) for r, t in plain]), measured)
  y = [t - c - sync_seconds(fraction, cap, t - c, _count(est)) for (_, est, c, *_), t in plain]
  coef = _fit([(r[1], t) for (r, _), t in zip(plain, y)])
  if n > 1:  # the cap lets the references' own waits through (2 devices: chains gave 0)
    cap = max([cap, *(fraction * _compute(coef, r[1]) / max(_count(r[1]), 1)
                      for r, _ in measured if r[1].method != "DataParallel")])
  fitted = [_compute(coef, r[1]) for r, _ in plain]
  profile = Profile(
      platform=devices[0].platform, device_kind=str(getattr(devices[0], "device_kind", "")),
      num_devices=n, seconds_per_flop=float(coef[0]), seconds_per_byte=float(coef[1]),
      overhead_s=float(coef[2]), seconds_per_kernel=float(coef[3]),
      points=tuple((r[0], float(t), float(ft)) for (r, _), t, ft in zip(plain, y, fitted)),
      created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      jax_version=jax.__version__, path=str(profile_path(devices)), alpha_s=alpha,
      beta_s_per_byte=beta, sync_fraction=fraction if n > 1 else None, sync_cap_s=cap)
  for (name, est, *_), t in plain:
    log.info("calibration %s: %.3f ms measured, %.3g flops, %.3g bytes, %d kernels", name,
             t * 1e3, est.flops, est.bytes_accessed, est.kernels)
  return profile, [float(np.median(t)) for t in per_round[len(runs):]]


def _count(est) -> int:
  return sum(c["count"] for c in est.collectives.values())


def _compute(coef, est) -> float:
  return float(coef[0] * est.flops + coef[1] * est.bytes_accessed + coef[2]
               + coef[3] * est.kernels)


def _fit(rows) -> np.ndarray:
  """Non-negative (seconds per flop, per byte, overhead, per kernel) of ``(estimate,
  seconds)`` rows, each weighted by the inverse of its seconds (relative errors)."""
  from scipy.optimize import nnls

  a = np.array([[est.flops, est.bytes_accessed, 1.0, est.kernels] for est, _ in rows])
  y = np.array([max(t, 0.0) for _, t in rows])
  scale = a.max(axis=0)
  weight = 1.0 / np.maximum(y, 1e-6)
  coef, _ = nnls(a / scale * weight[:, None], y * weight)
  return coef / scale


def _sync_fraction(coef, measured) -> float:
  """The share of its compute a step loses waiting at its collectives, from the ZeRO-2
  runs of reference models against their DataParallel runs in the same round: what
  ZeRO-2 costs beyond its change in fitted compute and link time, over its fitted
  compute (the median over models and rounds). Paired so, a model's own misfit and a
  slow spell of the machine cancel; on 8 simulated CPU devices single shares spread
  over 0.1-0.7."""
  dp = {r[0]: (r, t) for r, t in measured if r[1].method == "DataParallel"}
  shares = []
  for (name, est, communication, *_), rounds in measured:
    if est.method == "DataParallel":
      continue
    (_, base, base_communication, *_), base_rounds = dp[name]
    compute = _compute(coef, est)
    fitted = (compute - _compute(coef, base)) + (communication - base_communication)
    own = [(t - base_t - fitted) / max(compute, 1e-9) for t, base_t in zip(rounds, base_rounds)]
    shares += own
    log.info("calibration %s Zero2Parallel: %s ms measured, waits %.3g of %.3f ms compute",
             name, "/".join(f"{t * 1e3:.1f}" for t in rounds), float(np.median(own)),
             compute * 1e3)
  return float(np.clip(np.median(shares), 0.0, 1.0)) if shares else 0.0


def _link_costs(devices, steps: int, rounds: int) -> tuple[float, float]:
  """(α, β) of all-reduces over ``devices``: chains of 1 and 17 dependent all-reduces,
  of 4 bytes and of 4 MiB per device; α from the small ones, β from the large."""
  import jax
  import jax.numpy as jnp

  n = len(devices)

  def chain(count):
    def body(x):
      for _ in range(count):
        x = jax.lax.psum(x, "d") * (1.0 / n)
      return x
    return body

  per_op = []
  for per_device in (1, 2**20):  # float32 elements
    x = jnp.ones((n * per_device,), jnp.float32)
    one, many = _chains_seconds(devices, [chain(1), chain(17)], x, steps, rounds)
    per_op.append(max(many - one, 0.0) / 16)
  alpha = per_op[0]
  beta = max(per_op[1] - alpha, 0.0) / (2 * (n - 1) / n * 4 * 2**20)
  log.info("calibration links: α %.3g s, β %.3g s/byte", alpha, beta)
  return alpha, beta


def _sync_cap(devices, steps: int, rounds: int, alpha: float) -> float:
  """The most a collective costs beyond α after long compute: chains of 16 matrix
  products per device (512 wide, ~10 ms each on 8 simulated CPU devices), with and
  without a 4-byte all-reduce after each."""
  import jax
  import jax.numpy as jnp

  count, size = 16, 512

  def chain(synced):
    def body(w):
      for _ in range(count):
        w = jnp.tanh(w @ w) * 0.5
        if synced:
          w = w + jax.lax.psum(w[0, :1], "d")[0] * 1e-9
      return w
    return body

  w = jnp.full((len(devices) * size, size), 0.01, jnp.float32)
  plain, synced = _chains_seconds(devices, [chain(False), chain(True)], w, steps, rounds)
  cap = max((synced - plain) / count - alpha, 0.0)
  log.info("calibration sync: at most %.3g s per collective", cap)
  return cap


def _chains_seconds(devices, bodies, x, steps: int, rounds: int) -> list[float]:
  """Median seconds of each of ``bodies`` run by every device (mesh axis ``"d"``) on its
  shard of ``x``'s first dimension, timed in interleaved rounds: the figures are
  differences of two chains, and timed one after the other a slow spell under one of
  them moved the sync share of a profile from 0.18 to 0.04."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from jaxdist.measure import time_in_rounds

  mesh, spec = Mesh(np.array(devices), ("d",)), PartitionSpec("d")
  x = jax.device_put(x, NamedSharding(mesh, spec))
  runs = []
  for body in bodies:
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    runs.append((lambda y, run=run: (run(y), None), x))
  return time_in_rounds(runs, rounds, steps)


def store(profile: Profile) -> None:
  """Writes ``profile`` to its path, where estimates on its devices find it."""
  path = Path(profile.path)
  data = dataclasses.asdict(profile)
  data.pop("path")
  data["version"] = VERSION
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
  except OSError as e:
    log.warning("calibration profile not written (%s): %s", path, e)


def _reference_steps(n: int, models, optax):
  """Small steps with different ratios of flops to bytes, sized for ``n`` devices, their
  gradients taken with ``jaxdist.value_and_grad`` (see the module docstring)."""
  from jaxdist.grad import value_and_grad

  for hidden, rows in ((256, 16), (512, 8), (512, 64), (1024, 16)):
    data = models.regression_batch(rows * n, hidden, out=hidden)
    state = models.create_state(models.MLP(hidden=hidden, num_layers=4, out=hidden), data["x"],
                                tx=optax.adam(1e-3))
    yield f"mlp-{hidden}x{rows}", (models.regression_step(value_and_grad), state, data)
  # (the last: many small ops, whose time is mostly its kernels')
  for width, rows, depth, seq in ((128, 2, 2, 64), (256, 2, 2, 64), (256, 8, 2, 64),
                                  (64, 2, 8, 16)):
    config = models.GPTConfig(vocab=512, width=width, heads=4, depth=depth, seq_len=seq)
    batch = models.token_batch(rows * n, config)
    state = models.create_state(models.GPT(config), batch["tokens"][:, :-1],
                                tx=optax.adam(1e-3))
    name = f"gpt-{width}x{rows}" + (f"-depth{depth}" if depth != 2 else "")
    yield name, (models.lm_step(value_and_grad), state, batch)
