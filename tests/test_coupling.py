"""Steps whose examples interact beyond the loss's mean (BatchNorm in training mode) keep
the single-device semantics under DataParallel and ZeRO with jaxdist.grad: gradients are
computed over the whole batch, not per device. Numerics: SGD with momentum, rtol 1e-5 /
atol 1e-6 against the serial step."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxdist as jd
from jaxdist import errors, jaxpr_util, models
from jaxdist.bench import wresnet
from jaxdist.coupling import batch_coupling, normalizer_of
from jaxdist.trace import trace_step
from helpers import assert_trees_close, clip_loss, serial, to_host

CONFIG = wresnet.WResNetConfig(image_size=8, base_width=4, width_factor=2)


@pytest.mark.parametrize("method", [jd.DataParallel(), jd.Zero2Parallel(), jd.Zero3Parallel()],
                         ids=["dp", "zero2", "zero3"])
def test_batch_norm_step_matches_serial(method):
  step = wresnet.train_step(jd.value_and_grad)
  batch = wresnet.batch(16, CONFIG)
  expected = to_host(serial(step, wresnet.create_state(CONFIG), batch))
  exe = jd.parallelize(step, method=method).get_executable(wresnet.create_state(CONFIG), batch)
  got = to_host(exe(wresnet.create_state(CONFIG), batch))
  assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)
  assert any("mixes examples beyond the loss's mean" in n for n in exe.plan.notes)
  # The batch statistics are reduced across devices, and the plan predicts it (before:
  # 1 all-reduce predicted where XLA compiled 15).
  assert not [line for line in exe.check_communication() if "DIFFERS" in line]


@pytest.mark.parametrize("method", [jd.DataParallel, jd.Zero3Parallel], ids=["dp", "zero3"])
def test_batch_norm_micro_batches_enter_the_loop_split_over_all_devices(method):
  """Each 1/k slice of the batch lies on 1/k of the devices: it is spread over all of them
  once, before the loop. Before, XLA gathered every slice in the loop and computed the
  first conv's kernel gradient on the whole micro-batch on every device (a 2-block ResNet
  under DataParallel(num_micro_batches=2): 6 all-gathers, 1.2 MB, none predicted)."""
  step = wresnet.train_step(jd.value_and_grad)
  batch = wresnet.batch(16, CONFIG)
  f = jd.parallelize(step, method=method(num_micro_batches=2))
  with pytest.warns(errors.ResultsDifferWarning):
    exe = f.get_executable(wresnet.create_state(CONFIG), batch)
  if method is jd.DataParallel:  # (ZeRO-3 gathers its parameters)
    assert "all-gather" not in exe.communication(), exe.check_communication()
  assert not [line for line in exe.check_communication() if "DIFFERS" in line]
  # Estimated from the micro-batch trace the planner aligns with its own equations (an
  # un-inlined trace misaligned them: DataParallel / ZeRO-3 at 1.07x / 1.36x of XLA's
  # bytes here, 0.99x / 0.99x now).
  with pytest.warns(errors.ResultsDifferWarning):
    est = jd.estimate(f, wresnet.create_state(CONFIG), batch)
  assert abs(est.memory_per_device / exe.get_total_allocation_size() - 1) < 0.05, est.summary()


def test_coupling_is_found_only_where_examples_mix():
  bn = trace_step(wresnet.train_step(jd.value_and_grad),
                  (wresnet.create_state(CONFIG), wresnet.batch(16, CONFIG)), (), (1,), "auto")
  assert "batch statistic" in batch_coupling(bn)
  config = models.GPTConfig(vocab=64, width=16, heads=2, depth=1, seq_len=8)
  batch = models.token_batch(8, config)
  gpt = trace_step(models.lm_step(jd.value_and_grad),
                   (models.create_state(models.GPT(config), batch["tokens"][:, :-1]), batch),
                   (), (1,), "auto")
  assert batch_coupling(gpt) is None
  # ... and an independent step keeps the per-device path (one reduction per step).
  exe = jd.parallelize(models.lm_step(jd.value_and_grad), method=jd.DataParallel()).get_executable(
      models.create_state(models.GPT(config), batch["tokens"][:, :-1]), batch)
  assert exe.layout.grad_reduce_specs is not None


def test_only_a_batch_sum_dividing_a_batch_sum_is_a_token_count():
  """``(l * mask).sum() / mask.sum()`` is weighted exactly by micro-batches' counts; a
  clamped count (``maximum(mask.sum(), 1)``), a mean under a sum, or a divisor computed
  from the parameters is not a count, and such a step stays coupled (whole-batch
  gradients, by XLA)."""
  import jax
  import jax.numpy as jnp

  params = {"w": jnp.ones((4, 3))}
  batch = {"x": jnp.ones((8, 4)), "mask": jnp.ones((8, 3))}

  def step_with(divisor):
    def step(params, batch):
      def loss_fn(p):
        err = (batch["x"] @ p["w"]) ** 2 * batch["mask"]
        return err.sum() / divisor(p, batch["mask"])

      loss, grads = jd.value_and_grad(loss_fn)(params)
      return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss
    return trace_step(step, (params, batch), (), (1,), "auto")

  count = step_with(lambda p, mask: mask.sum())
  assert batch_coupling(count) is None
  clamped = step_with(lambda p, mask: jnp.maximum(mask.sum(), 1.0))
  assert "batch statistic" in batch_coupling(clamped)
  # A sum over a mean: weighting micro-batches by their means would be off by their number.
  mean = step_with(lambda p, mask: mask.mean())
  assert "batch statistic" in batch_coupling(mean)
  learned = step_with(lambda p, mask: mask.sum() + p["w"].sum())
  assert batch_coupling(learned) is not None


@pytest.mark.parametrize("loss,mask,found", [
    (lambda l, m: jnp.where(m, l, 0.0).sum() / jnp.maximum(m.sum(), 1), bool, True),
    (lambda l, m: jnp.where(m, l, 0.0).sum() / jnp.maximum(1, m.sum()), bool, True),
    (lambda l, m: jnp.where(m, l, 0.0).sum() / jnp.clip(m.sum(), 1), bool, True),
    (lambda l, m: (l * m).sum() / jnp.clip(m.astype(jnp.float32).sum(), 1.0), bool, True),
    (lambda l, m: (l * m).sum() / m.sum(), jnp.float32, True),
    # a float mask's share may weigh less than the bound; a bound above 1 clamps counts
    (lambda l, m: (l * m).sum() / jnp.maximum(m.sum(), 1.0), jnp.float32, False),
    (lambda l, m: jnp.where(m, l, 0.0).sum() / jnp.maximum(m.sum(), 2), bool, False),
], ids=["maximum", "maximum-reversed", "clip", "clip-cast", "plain", "float-mask", "bound-2"])
def test_token_counts_clamped_against_zero_are_normalizers(loss, mask, found):
  """``jnp.clip`` passes its bound through a cast inside a call: following it into the
  literal raised TypeError (unhashable Literal) while the step was traced."""
  closed = jaxpr_util.inline_calls(jax.make_jaxpr(loss)(jnp.ones(8), jnp.ones(8, mask)))
  jaxpr = closed.jaxpr
  assert (normalizer_of(jaxpr.eqns, jaxpr.outvars[0], set()) is not None) == found


@pytest.mark.parametrize("method", [pytest.param(jd.Zero2Parallel(), marks=pytest.mark.slow),
                                    jd.Zero3Parallel()], ids=["zero2", "zero3"])
def test_zero_updates_a_batch_norm_step_s_adam_moments_on_their_shards(method):
  """Planned as one program, the update followed the gradient's layout: XLA gathered
  both Adam moments of every leaf (twice the parameters' bytes) instead of the update
  (once), and ZeRO-2 needed more memory than DataParallel (a BatchNorm WideResNet: 4.58
  MB against 3.94 now, 47.2 ms per step against 42.0). The update now follows the
  moments' shards."""
  import optax

  config = wresnet.WResNetConfig(image_size=16, base_width=16, width_factor=2)
  step, batch = wresnet.train_step(jd.value_and_grad), wresnet.batch(16, config)
  make = lambda: wresnet.create_state(config, tx=optax.adam(1e-3))
  params = sum(x.nbytes for x in jax.tree.leaves(make().params))
  dp = jd.parallelize(step, method=jd.DataParallel()).get_executable(make(), batch)
  exe = jd.parallelize(step, method=method).get_executable(make(), batch)
  gathered = exe.communication()["all-gather"].result_bytes
  assert gathered <= 1.3 * params, (gathered, params)
  assert exe.get_total_allocation_size() < 0.9 * dp.get_total_allocation_size()
  assert not [line for line in exe.check_communication() if "DIFFERS" in line]
  assert_trees_close(to_host(exe(make(), batch)), to_host(serial(step, make(), batch)),
                     rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss,coupled", [
    (lambda e: e.mean() + 0.5 * (e ** 2).mean(), False),
    (lambda e: e.mean() - 0.5 * jnp.mean(jnp.sum(e, -1)), False),  # a VAE's scaled KL term
    (lambda e: 0.1 * e.mean(), False),
    (lambda e: e.mean() + 0.5 * e.sum(), True),
    (lambda e: e.sum() + (e ** 2).mean(), True),
], ids=["weighted-means", "scaled-mean-of-sums", "scaled-mean", "mean-plus-sum", "sum-plus-mean"])
def test_a_scaled_mean_is_a_mean(loss, coupled):
  """``rec + beta * kl`` with both means: each micro-batch's value is a mean too, so the
  step splits exactly (it was taken for a sum beside a mean: a ResultsDifferWarning, and
  the whole batch ran as one program under DataParallel)."""
  params = {"w": jnp.ones((4, 3))}
  batch = {"x": jnp.ones((8, 4))}

  def step(params, batch):
    value, grads = jd.value_and_grad(lambda p: loss(batch["x"] @ p["w"]))(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), value

  found = batch_coupling(trace_step(step, (params, batch), (), (1,), "auto"))
  assert (found is not None) == coupled, found


def test_a_graph_s_edges_reading_their_nodes_couple_examples():
  """A graph network's batch is its nodes and edges; ``x[senders]`` reads nodes by
  indices that are no node's own. Split per device, each device's edges read a
  different device's nodes: DataParallel's update was 0.55 off serial without a word.
  Now the step is coupled and runs as one whole-batch program."""
  nodes, edges = 64, 256
  keys = jax.random.split(jax.random.key(0), 5)
  batch = {"x": jax.random.normal(keys[0], (nodes, 16)), "y": jax.random.normal(keys[1], (nodes,)),
           "senders": jax.random.randint(keys[2], (edges,), 0, nodes),
           "receivers": jax.random.randint(keys[3], (edges,), 0, nodes)}
  params = {"w": jax.random.normal(keys[4], (16, 16)) / 4, "out": jnp.ones((16,)) / 4}

  def step(params, batch):
    def loss_fn(p):
      msg = (batch["x"] @ p["w"])[batch["senders"]]
      h = jax.nn.relu(jax.ops.segment_sum(msg, batch["receivers"], num_segments=nodes))
      return jnp.mean((h @ p["out"] - batch["y"]) ** 2)

    loss, grads = jd.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss

  traced = trace_step(step, (params, batch), (), (1,), "auto")
  assert "indexes examples of the batch by indices" in batch_coupling(traced)
  f = jd.parallelize(step, method=jd.DataParallel())
  assert_trees_close(f(params, batch), serial(step, params, batch), rtol=1e-5, atol=1e-6)
  # A per-example lookup (its indices carry the batch) stays uncoupled.
  labels = jnp.zeros((nodes,), jnp.int32)

  def lookup(params, batch):
    def loss_fn(p):
      logits = batch["x"] @ p["w"]
      return -jnp.mean(logits[jnp.arange(nodes), batch["labels"]])

    loss, grads = jd.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss

  traced = trace_step(lookup, (params, {"x": batch["x"], "labels": labels}), (), (1,), "auto")
  assert batch_coupling(traced) is None


def test_a_table_in_the_batch_read_by_labels_is_no_example_s_row():
  """Class weights passed inside the batch and read by each example's label
  (``batch["weights"][labels]``): split like examples, each device read its part of the
  table with every label, and DataParallel's update was 1.2e-2 off serial without a word
  when the table was as long as the batch. Now that step runs as one whole-batch program;
  a table of another length raises naming it."""
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"w": jax.random.normal(keys[0], (16, 32)) / 4}

  def step(params, batch):
    def loss_fn(p):
      losses = optax.softmax_cross_entropy_with_integer_labels(batch["x"] @ p["w"],
                                                               batch["y"])
      weights = batch["weights"][batch["y"]]
      return jnp.sum(losses * weights) / jnp.sum(weights)

    loss, grads = jd.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss

  for classes in (32, 10):
    batch = {"x": jax.random.normal(keys[1], (32, 16)),
             "y": jax.random.randint(keys[2], (32,), 0, classes),
             "weights": jax.random.uniform(keys[3], (classes,)) + 0.5}
    f = jd.parallelize(step, method=jd.DataParallel())
    if classes == 10:
      with pytest.raises(errors.BatchDivisibilityError, match=r"batch\['weights'\].*argument "
                                                              r"of its own"):
        f(params, batch)
      continue
    assert "by values of the batch" in batch_coupling(
        trace_step(step, (params, batch), (), (1,), "auto"))
    assert_trees_close(f(params, batch), serial(step, params, batch), rtol=1e-5, atol=1e-6)


def _linear_step(mix):
  """(step, params, batch): a linear regression over 64 examples whose predictions pass
  through ``mix`` before the loss, SGD."""
  keys = jax.random.split(jax.random.key(0), 3)
  batch = {"x": jax.random.normal(keys[0], (64, 16)), "y": jax.random.normal(keys[1], (64,))}
  params = {"w": jax.random.normal(keys[2], (16,)) / 4}

  def step(params, batch):
    loss, grads = jd.value_and_grad(
        lambda p: jnp.mean((mix(batch["x"] @ p["w"]) - batch["y"]) ** 2))(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss

  return step, params, batch


@pytest.mark.parametrize("mix", [
    lambda h: h - jnp.roll(h, 1, axis=0),
    lambda h: h * h[::-1],
    lambda h: jnp.concatenate([h[:32] - h[32:], h[32:] - h[:32]]),
    lambda h: jnp.cumsum(h, axis=0) / 64,
    lambda h: jnp.sort(h, axis=0),
    lambda h: h.at[0].set(0.0),
    lambda h: jnp.zeros_like(h).at[:8].set(jax.lax.top_k(h, 8)[0]),
    lambda h: jax.nn.softmax(h[:, None] @ h[None, :], axis=1) @ h,
    lambda h: jnp.abs(h[:, None] - h[None, :]).mean(1),
    lambda h: (lambda z: jax.nn.softmax(z[:, None] * z[None, :], 1) @ z)(
        jnp.concatenate([h, 2 * h])).reshape(2, -1).sum(0),
    lambda h: (lambda a, b: jnp.concatenate([a - b, b - a]))(*jnp.split(h, 2)),
], ids=["roll", "reverse", "halves", "cumsum", "sort", "scatter", "top-k", "similarity",
        "distances", "two-views", "split"])
def test_moving_examples_along_the_batch_axis_couples_them(mix):
  """Per device, each device would roll, reverse, pair, accumulate, sort, write or rank
  its own examples only, or meet them with its own only (in-batch negatives, of one or
  of two views of the batch): DataParallel's update was 0.2 to 1.2 off serial without a
  word (the halves raised a TypeError; a SimCLR step's, 0.5). Now such a step runs as one
  whole-batch program."""
  step, params, batch = _linear_step(mix)

  assert batch_coupling(trace_step(step, (params, batch), (), (1,), "auto")) is not None
  f = jd.parallelize(step, method=jd.DataParallel())
  assert_trees_close(f(params, batch), serial(step, params, batch), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("time_major", [False, True], ids=["batch-major", "time-major"])
def test_tokens_flattened_across_the_batch_are_still_followed(time_major):
  """A Switch-style router flattens the batch's tokens ``(B, L, D) -> (B * L, D)`` and
  counts each expert's tokens with a cumsum over all of them (its capacity): per device,
  each device filled its experts with its own tokens only, and DataParallel's update was
  7e-3 off serial without a word; flattened time-major (``(L, B, D) -> (L * B, D)``),
  1.8e-2 off even after that was fixed. A per-token loss over flattened tokens stays per
  device."""
  b, l, d, experts, capacity = 16, 8, 8, 4, 12
  keys = jax.random.split(jax.random.key(0), 4)
  batch = {"x": jax.random.normal(keys[0], (b, l, d)), "y": jax.random.normal(keys[1], (b,))}
  params = {"gate": jax.random.normal(keys[2], (d, experts)),
            "w": jax.random.normal(keys[3], (experts, d, d)) / 4}

  def flat(x):
    return x.transpose(1, 0, 2).reshape(l * b, -1) if time_major else x.reshape(b * l, -1)

  def unflat(t):
    return t.reshape(l, b, -1).transpose(1, 0, 2) if time_major else t.reshape(b, l, -1)

  def routed(p, x):
    t = flat(x)
    choice = jax.nn.one_hot(jnp.argmax(t @ p["gate"], -1), experts)
    kept = choice * (jnp.cumsum(choice, axis=0) <= capacity)
    return unflat(t + jnp.einsum("te,td,edf->tf", kept, t, p["w"]))

  def step(params, batch):
    loss, grads = jd.value_and_grad(
        lambda p: jnp.mean((routed(p, batch["x"]).mean((1, 2)) - batch["y"]) ** 2))(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss

  assert "cumsum" in batch_coupling(trace_step(step, (params, batch), (), (1,), "auto"))
  f = jd.parallelize(step, method=jd.DataParallel())
  assert_trees_close(f(params, batch), serial(step, params, batch), rtol=1e-5, atol=1e-6)

  def per_token(params, batch):
    def loss_fn(p):
      logits = flat(batch["x"] @ p["gate"])
      labels = jnp.zeros((b * l,), jnp.int32)
      losses = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1)
      return jnp.mean(unflat(losses).mean(1) * batch["y"][:, None])

    loss, grads = jd.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss

  assert batch_coupling(trace_step(per_token, (params, batch), (), (1,), "auto")) is None

  def centered(params, batch):  # the batch axis is found again after the round trip
    def loss_fn(p):
      h = unflat(flat(batch["x"]) @ p["gate"])
      return jnp.mean((h - h.mean(0)) ** 2)

    loss, grads = jd.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss

  assert "reduced over the batch" in batch_coupling(
      trace_step(centered, (params, batch), (), (1,), "auto"))


def test_a_scan_carrying_state_along_the_batch_axis_couples_examples():
  """A time-major RNN (``(time, batch, features)``) passed as the batch is split on its
  time axis: per device each device started its recurrence from zeros at its own first
  step, and DataParallel's update was 1.5e-2 off serial without a word. Scans over time
  of batch-major data, and ``lax.map`` over the examples, stay per device."""
  time_, b, d, h = 32, 4, 8, 16
  keys = jax.random.split(jax.random.key(0), 5)
  batch = {"x": jax.random.normal(keys[0], (time_, b, d)),
           "y": jax.random.normal(keys[1], (time_, b))}
  params = {"wx": jax.random.normal(keys[2], (d, h)) / 3,
            "wh": jax.random.normal(keys[3], (h, h)) / 4,
            "wo": jax.random.normal(keys[4], (h,)) / 4}

  def rnn(p, xs):
    def cell(carry, x):
      carry = jnp.tanh(x @ p["wx"] + carry @ p["wh"])
      return carry, carry @ p["wo"]
    return jax.lax.scan(cell, jnp.zeros(xs.shape[1:2] + (h,)), xs)[1]

  def make_step(predict):
    def step(params, batch):
      loss, grads = jd.value_and_grad(
          lambda p: jnp.mean((predict(p, batch["x"]) - batch["y"]) ** 2))(params)
      return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss
    return step

  step = make_step(rnn)
  assert "time-major" in batch_coupling(trace_step(step, (params, batch), (), (1,), "auto"))
  f = jd.parallelize(step, method=jd.DataParallel())
  assert_trees_close(f(params, batch), serial(step, params, batch), rtol=1e-5, atol=1e-6)
  batch_major = {"x": batch["x"].swapaxes(0, 1), "y": batch["y"].swapaxes(0, 1)}
  for predict in (lambda p, x: rnn(p, x.swapaxes(0, 1)).swapaxes(0, 1),
                  lambda p, x: jax.lax.map(lambda e: rnn(p, e[:, None])[:, 0], x)):
    traced = trace_step(make_step(predict), (params, batch_major), (), (1,), "auto")
    assert batch_coupling(traced) is None


@pytest.mark.parametrize("views", [
    lambda h: sum(jnp.split(jnp.tanh(jnp.concatenate([h, 2 * h])), 2)),
    lambda h: (lambda z: z[:64] * z[64:])(jnp.concatenate([h, h + 1.0]) ** 2),
], ids=["split", "slices"])
def test_two_views_of_the_batch_split_back_stay_per_device(views):
  """A discriminator reading real and generated examples as one batch
  (``concatenate([real, fake])``) and splitting its outputs back into whole batches
  reads each example alone: the step keeps the per-device path."""
  step, params, batch = _linear_step(views)

  assert batch_coupling(trace_step(step, (params, batch), (), (1,), "auto")) is None


def test_a_loop_that_stops_on_a_batch_statistic_couples_examples():
  """A fixed point iterated until every example converged (``max |z' - z| > tol`` over
  the batch): per device, each device stopped when its own examples had, and
  DataParallel's update was 1.4e-2 off serial without a word. A loop of a fixed count
  stays per device."""
  keys = jax.random.split(jax.random.key(0), 4)
  batch = {"x": jax.random.normal(keys[0], (64, 16)), "y": jax.random.normal(keys[1], (64,))}
  params = {"w": jax.random.normal(keys[2], (16, 16)) / 8,
            "u": jax.random.normal(keys[3], (16, 16)) / 4}

  def fixed_point(p, x, converged):
    def body(carry):
      z, i, _ = carry
      new = jnp.tanh(z @ p["w"] + x @ p["u"])
      return new, i + 1, jnp.max(jnp.abs(new - z))
    return jax.lax.while_loop(converged, body, (jnp.zeros_like(x), 0, jnp.inf))[0]

  def make_step(converged):
    def step(params, batch):
      def loss_fn(p):
        z = fixed_point(jax.lax.stop_gradient(p), batch["x"], converged)
        return jnp.mean((jnp.tanh(z @ p["w"] + batch["x"] @ p["u"]).sum(-1) - batch["y"]) ** 2)
      loss, grads = jd.value_and_grad(loss_fn)(params)
      return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss
    return step

  step = make_step(lambda c: (c[1] < 30) & (c[2] > 3e-2))
  assert "statistic over the batch" in batch_coupling(
      trace_step(step, (params, batch), (), (1,), "auto"))
  f = jd.parallelize(step, method=jd.DataParallel())
  assert_trees_close(f(params, batch), serial(step, params, batch), rtol=1e-5, atol=1e-6)
  counted = make_step(lambda c: c[1] < 30)
  assert batch_coupling(trace_step(counted, (params, batch), (), (1,), "auto")) is None


def test_a_branch_that_centers_on_the_batch_couples_examples():
  """``lax.cond(train, center_on_the_batch_mean, identity, h)``: the branch's statistic
  was each device's own, and DataParallel's update was 1.9e-2 off serial without a word."""
  keys = jax.random.split(jax.random.key(0), 3)
  batch = {"x": jax.random.normal(keys[0], (64, 16)), "y": jax.random.normal(keys[1], (64,))}
  params = {"w": jax.random.normal(keys[2], (16, 8)) / 4}

  def step(params, batch, train):
    def loss_fn(p):
      h = jax.lax.cond(train, lambda h: h - h.mean(0), lambda h: h, batch["x"] @ p["w"])
      return jnp.mean((jnp.tanh(h).sum(-1) - batch["y"]) ** 2)
    loss, grads = jd.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss

  train = jnp.bool_(True)
  assert "in a branch" in batch_coupling(trace_step(step, (params, batch, train), (), (1,), "auto"))
  f = jd.parallelize(step, method=jd.DataParallel())
  assert_trees_close(f(params, batch, train), serial(step, params, batch, train),
                     rtol=1e-5, atol=1e-6)


def _contrastive_loss(params, batch):
  """CLIP's loss: each image's text is the positive, the batch's other texts negatives."""
  return clip_loss(jnp.tanh(batch["img"] @ params["wi"]), jnp.tanh(batch["txt"] @ params["wt"]))


@pytest.mark.parametrize("method", [jd.DataParallel, jd.Zero2Parallel, jd.Zero3Parallel,
                                    jd.ShardParallel], ids=["dp", "zero2", "zero3", "sp"])
def test_micro_batches_of_a_contrastive_step_are_slices_of_the_whole_batch(method):
  """With micro-batches, a step whose examples meet (in-batch negatives) computes what
  accumulating by hand over the batch's k slices computes. Before, each device ran its
  own share of each micro-batch: 2 negatives per example instead of 8 (4e-3 off)."""
  def step(params, batch):
    loss, grads = jd.value_and_grad(_contrastive_loss)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

  def by_hand(params, batch, k=2):
    n = batch["img"].shape[0] // k
    parts = [jax.value_and_grad(_contrastive_loss)(
        params, jax.tree.map(lambda x: x[i * n:(i + 1) * n], batch)) for i in range(k)]
    grads = jax.tree.map(lambda *g: sum(g) / k, *[g for _, g in parts])
    return (jax.tree.map(lambda p, g: p - 0.5 * g, params, grads),
            sum(loss for loss, _ in parts) / k)

  keys = jax.random.split(jax.random.key(0), 4)
  params = {"wi": jax.random.normal(keys[0], (12, 16)), "wt": jax.random.normal(keys[1], (10, 16))}
  batch = {"img": jax.random.normal(keys[2], (32, 12)), "txt": jax.random.normal(keys[3], (32, 10))}
  expected = jax.jit(by_hand)(params, batch)
  f = jd.parallelize(step, method=method(num_micro_batches=2))
  with pytest.warns(errors.ResultsDifferWarning, match="num_micro_batches=2, the micro-batches"):
    got = f(params, batch)
  assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)
  # Each slice is spread over all devices once, before the loop: its collectives, and the
  # gradients' reduction in every micro-batch, are predicted.
  exe = f.get_executable(params, batch)
  assert not [line for line in exe.check_communication() if "DIFFERS" in line]
