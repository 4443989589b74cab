"""jaxdist bench: the suites run their methods and match the serial first step, the CSV
keeps its typed schema, and the GPT flop count is the traced step's."""

import math

import jax
import pytest

from jaxdist import errors
from jaxdist.bench import run as bench_run
from jaxdist.bench.suites import gpt_flops, workload


def test_gpt_flops_formula_is_the_traced_steps_matmuls():
  """Megatron-LM's 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)) against a hand count: the
  dot_general flops of the traced serial step (forward and backward)."""
  w = workload("gpt", "tiny")
  counted = bench_run.model_flops(w, w.make_state())
  assert counted == pytest.approx(w.formula_flops, rel=1e-9)
  assert w.formula_flops == gpt_flops(16, 32, 2, 64, 256)


def _assert_csv_round_trip(rows, tmp_path):
  bench_run.write(rows, tmp_path)
  bench_run.write(rows[:1], tmp_path)  # appends
  back = bench_run.read_csv(tmp_path / "results.csv")
  assert len(back) == len(rows) + 1
  for b, r in zip(back, rows):  # typed columns come back typed
    assert b.method == r.method and b.status == "ok" and b.matches_serial is r.matches_serial
    assert isinstance(b.bytes_per_device, int) and isinstance(b.num_devices, int)
    assert b.step_time_mean_s == pytest.approx(r.step_time_mean_s)
    assert b.formula_flops == r.formula_flops


# Each suite takes over a minute (every method's compile, the automatic pipeline's stage
# profiling): `make test-all` runs them; `make test` runs the bench path through the row
# for jd.tune's pick below.
@pytest.mark.slow
@pytest.mark.parametrize("suite", ["gpt", "moe", "wresnet"])
def test_tiny_suites_run_every_method_and_match_serial(suite, tmp_path):
  """Every method of the suite runs and its first step equals the single-device step's.
  A pipeline on a BatchNorm model computes statistics per micro-batch, as gradient
  accumulation does: its first step equals the single-device step accumulated over the
  same 4 micro-batches instead."""
  import jaxdist as jd

  rows = bench_run.run([suite], "tiny", None, num_devices=8, repeat=1, show=False)
  names = [r.method for r in rows]
  expected = ["DataParallel", "ZeRO-2", "ZeRO-3 (FSDP)", "pipeline 2 stages",
              "ShardParallel (ILP)", "PipeshardParallel (auto)"]
  assert set(expected) <= set(names) and len(rows) >= len(expected), names
  w = workload(suite, "tiny")
  accumulated = jd.parallelize(w.step, method=jd.DataParallel(
      devices=jax.devices()[:1], num_micro_batches=4))(w.make_state(), w.batch)[1]["loss"]
  for r in rows:
    assert r.status == "ok", (r.method, r.reason)
    pipelined = r.method.lower().startswith(("pipeline", "pipeshard"))
    if suite == "wresnet" and pipelined:  # 4 micro-batches
      assert not r.matches_serial
      assert r.loss == pytest.approx(float(accumulated), rel=bench_run.LOSS_RTOL), r.method
    else:
      assert r.matches_serial, (r.method, r.loss, r.serial_loss)
    assert r.step_time_mean_s > 0 and r.bytes_per_device > 0 and r.projected_h100_s > 0
    assert 0 < r.projected_mfu < 1 and r.params > 0 and r.model_flops > 0
    if not pipelined:  # SPMD first calls are timed by phase
      assert 0 < r.trace_s and 0 <= r.plan_s and 0 < r.xla_compile_s < r.compile_s
  _assert_csv_round_trip(rows, tmp_path)
  table = bench_run.summary(rows)
  assert table[0]["model"] == f"{suite}-tiny"


@pytest.mark.slow
def test_a_row_for_the_method_tune_picks(tmp_path):
  """``--tune SECONDS``: jd.tune walks the model's candidates for that long (here only its
  first, DataParallel, starts: 50 ms is more than the walk takes to reach its first
  candidate on a loaded machine, where 1 ms was not, and less than that trial's compile)
  and its pick runs as an automatic row."""
  rows = bench_run.run(["gpt"], "tiny", ["ILP"], num_devices=8, repeat=1, show=False,
                       tune_budget_s=0.05)
  tuned = [r for r in rows if r.method.startswith(bench_run.TUNED)]
  assert len(rows) == 2 and len(tuned) == 1, [r.method for r in rows]
  r = tuned[0]
  assert r.method == "jd.tune's pick: DataParallel" and r.kind == "auto"
  assert r.status == "ok" and r.matches_serial and r.projected_h100_s > 0
  _assert_csv_round_trip(rows, tmp_path)
  assert bench_run.summary(rows)[0]["model"] == "gpt-tiny"


def test_unknown_sizes_and_suites_are_typed_errors():
  with pytest.raises(errors.InvalidArgumentError, match=r"size='huge'.*tiny, small"):
    workload("gpt", "huge")
  with pytest.raises(errors.InvalidArgumentError, match=r"paper-1.3B"):
    workload("gpt", "paper-2B")
  with pytest.raises(errors.InvalidArgumentError, match=r"suite='bert'"):
    workload("bert", "tiny")


@pytest.mark.parametrize("suite,size,billions", [
    ("gpt", "1.3B", 1.3), ("moe", "380M", 0.38), ("moe", "10B", 10.0),
    ("wresnet", "250M", 0.25), ("wresnet", "13B", 13.0)])
def test_paper_sizes_have_the_published_parameter_counts(suite, size, billions):
  """Alpa's configurations by name, sized from abstract shapes (nothing allocated): each
  within 10% of its name (MoE: experts in every other block, 8x MLPs; Wide-ResNet:
  bottleneck ResNet-50/101 with a widened 3x3 convolution)."""
  w = workload(suite, f"paper-{size}")
  params = jax.eval_shape(w.make_state).params
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  assert abs(count / (billions * 1e9) - 1) <= 0.10, count


def test_results_written_with_older_columns_are_rewritten(tmp_path):
  """A results.csv from an earlier version (fewer columns) is rewritten with today's
  columns when rows are appended; the JSON only appends."""
  row = bench_run.Row("gpt", "gpt-tiny", "DataParallel", "hand", "ok", 8, params=10)
  old_columns = [c for c in bench_run.COLUMNS if c not in ("trace_s", "plan_s")]
  with open(tmp_path / "results.csv", "w") as f:
    f.write(",".join(old_columns) + "\n")
    f.write(",".join("" if getattr(row, c) is None else str(getattr(row, c))
                     for c in old_columns) + "\n")
  bench_run.write([row], tmp_path)
  back = bench_run.read_csv(tmp_path / "results.csv")
  assert [b.params for b in back] == [10, 10] and back[0].trace_s is None
