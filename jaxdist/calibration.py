"""Fitting the step-time estimate to the present devices: ``jaxdist.calibrate``.

An estimate's compute time is ``overhead + flops · seconds_per_flop + bytes ·
seconds_per_byte`` (flops of dots and convolutions, bytes its buffers write and the
state it reads; see ``jaxdist.estimate``). Without a profile the two rates are the
device kind's peak flops and memory bandwidth, which real steps never reach. A profile
measures a few reference steps (the MLP and GPT of ``jaxdist.models`` at two sizes each,
DataParallel over the devices), and fits the three coefficients (non-negative least
squares on the measured time less the estimated communication, each step weighted by
the inverse of its time: the fit minimizes relative errors, so a 16 ms step counts as
much as a 600 ms one; unweighted, the slowest steps decided the fit and the fastest were
estimated 2x too slow on this CPU). The reference steps take their gradients with
``jaxdist.value_and_grad``, so DataParallel runs them as the estimate models every
SPMD method: one program per device and one explicit reduction of the gradients. A
``jax.value_and_grad`` step is partitioned by XLA instead, which all-reduces each
weight gradient before its transpose and then reads it transposed in every fusion of
the update: on 8 simulated CPU devices that made an 8-layer Adam MLP's step 1.9x slower
(57 vs 31 ms) at the same flops and bytes, and its references no line could fit.

A profile also measures the links: a chain of dependent all-reduces over all the
devices, of 4 bytes and of 4 MiB per device, gives the latency α of one collective and
the seconds per byte β (as the cost model charges an all-reduce: ``α + 2β(n-1)/n ·
bytes``). Estimates on a mesh at its device kind's default costs use them for the
communication time (on 8 simulated CPU devices α is ~0.2 ms and β ~1 ns/byte, where the
CPU defaults, a stand-in for a fast link, say 0.1 µs and 0.01 ns/byte).

A profile also measures what the devices lose waiting for each other at a collective:
chains of matrix products on every device, with and without a 4-byte all-reduce after
each, at two sizes. Beyond α, each all-reduce then cost a share of the compute since the
previous one, up to a cap: on 8 simulated CPU devices sharing 2 cores, 0.37 ms after
1.5 ms of compute and 1.8 ms after 10.7 ms. A plan with many collectives between short
computations (ZeRO-2's 141 per step on a GPT) loses that at each one; estimates on the
profile's devices add ``min(sync_fraction · compute, collectives · sync_cap_s)`` to the
communication time (the compute spread evenly between the collectives).

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

VERSION = 4  # 3: reference steps with jaxdist.value_and_grad; 4: sync costs
log = logging.getLogger("jaxdist.estimate")


@dataclasses.dataclass(frozen=True)
class Profile:
  """Fitted compute-time coefficients for one platform, device kind and device count.

  Attributes:
    seconds_per_flop, seconds_per_byte, overhead_s: the fitted coefficients.
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

  def compute_seconds(self, flops: float, nbytes: float) -> float:
    return self.overhead_s + flops * self.seconds_per_flop + nbytes * self.seconds_per_byte

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
  from jaxdist.measure import time_in_rounds
  from jaxdist.mesh import LogicalMesh

  n = len(devices)
  alpha, beta = _link_costs(devices, steps) if n > 1 else (None, None)
  fraction, cap = _sync_costs(devices, steps, alpha) if n > 1 else (None, None)
  references = []
  for name, (step, state, batch) in _reference_steps(n, models, optax):
    method = m.DataParallel(devices=devices)
    est = estimate(step, state, batch, method=method, calibrated=False)
    references.append((name, est, parallelize(step, method=method), state, batch))
  # Rounds over all references: one reference measured through a slow spell (seconds
  # long on shared cores) would bend every coefficient of the fit.
  times = time_in_rounds([(f, state, batch) for _, _, f, state, batch in references]
                         + list(alongside), rounds, steps)
  rows, names = [], []
  for (name, est, *_), seconds in zip(references, times):
    communication = est.communication_s
    if alpha is not None:
      measured = LogicalMesh((n,), alpha=alpha, beta=beta, devices=tuple(devices))
      communication = communication_seconds(est.collectives, measured)
    count = sum(c["count"] for c in est.collectives.values())
    communication += sync_seconds(fraction, cap, max(seconds - communication, 0.0), count)
    rows.append((est.flops, est.bytes_accessed, 1.0, max(seconds - communication, 0.0)))
    names.append(name)
    log.info("calibration %s: %.3f ms measured, %.3g flops, %.3g bytes", name, seconds * 1e3,
             est.flops, est.bytes_accessed)
  from scipy.optimize import nnls
  a = np.array([r[:3] for r in rows])
  y = np.array([r[3] for r in rows])
  scale = a.max(axis=0)
  weight = 1.0 / np.maximum(y, 1e-6)
  coef, _ = nnls(a / scale * weight[:, None], y * weight)
  coef = coef / scale
  fitted = a @ coef
  profile = Profile(
      platform=devices[0].platform, device_kind=str(getattr(devices[0], "device_kind", "")),
      num_devices=n, seconds_per_flop=float(coef[0]), seconds_per_byte=float(coef[1]),
      overhead_s=float(coef[2]),
      points=tuple((nm, float(t), float(ft)) for nm, t, ft in zip(names, y, fitted)),
      created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      jax_version=jax.__version__, path=str(profile_path(devices)), alpha_s=alpha,
      beta_s_per_byte=beta, sync_fraction=fraction, sync_cap_s=cap)
  return profile, times[len(references):]


def _link_costs(devices, steps: int) -> tuple[float, float]:
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
    one, many = (_chain_seconds(devices, chain(c), x, steps) for c in (1, 17))
    per_op.append(max(many - one, 0.0) / 16)
  alpha = per_op[0]
  beta = max(per_op[1] - alpha, 0.0) / (2 * (n - 1) / n * 4 * 2**20)
  log.info("calibration links: α %.3g s, β %.3g s/byte", alpha, beta)
  return alpha, beta


def _sync_costs(devices, steps: int, alpha: float) -> tuple[float, float]:
  """(sync_fraction, sync_cap_s): chains of 16 matrix products per device (256 and 512
  wide), with and without a 4-byte all-reduce after each; beyond α each all-reduce
  costs a share of the compute before it (the mean of the two sizes'), at most the
  larger of the two sizes' costs."""
  import jax
  import jax.numpy as jnp

  count = 16

  def chain(synced):
    def body(w):
      for _ in range(count):
        w = jnp.tanh(w @ w) * 0.5
        if synced:
          w = w + jax.lax.psum(w[0, :1], "d")[0] * 1e-9
      return w
    return body

  shares, costs = [], []
  for size in (256, 512):
    w = jnp.full((len(devices) * size, size), 0.01, jnp.float32)
    plain, synced = (_chain_seconds(devices, chain(s), w, steps) for s in (False, True))
    cost = max((synced - plain) / count - alpha, 0.0)
    shares.append(cost / max(plain / count, 1e-9))
    costs.append(cost)
  log.info("calibration sync: %.3g of the compute before a collective, at most %.3g s",
           float(np.mean(shares)), max(costs))
  return float(np.mean(shares)), max(costs)


def _chain_seconds(devices, body, x, steps: int) -> float:
  """Median seconds of ``body`` run by every device (mesh axis ``"d"``) on its shard of
  ``x``'s first dimension."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from jaxdist.measure import time_steps

  mesh, spec = Mesh(np.array(devices), ("d",)), PartitionSpec("d")
  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
  x = jax.device_put(x, NamedSharding(mesh, spec))
  return time_steps(lambda y: (run(y), None), x, num_steps=steps, warmup=2)[2]


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
  for width, rows in ((128, 2), (256, 2), (256, 8)):
    config = models.GPTConfig(vocab=512, width=width, heads=4, depth=2, seq_len=64)
    batch = models.token_batch(rows * n, config)
    state = models.create_state(models.GPT(config), batch["tokens"][:, :-1],
                                tx=optax.adam(1e-3))
    yield f"gpt-{width}x{rows}", (models.lm_step(value_and_grad), state, batch)
