"""jaxdist.advise against published reference points (sources in each test's name and
docstring), its rules and errors, and its methods run against the serial step.

Numerics of the methods the advisor hands out: SGD with momentum (Adam would turn the
key bias's zero-in-theory gradient noise into full steps), rtol 1e-4 / atol 1e-6 against
the single-device step (sharded reductions change the summation order)."""

import csv
import json
import warnings

import optax
import pytest

import jaxdist as jd
from jaxdist import errors, models
from jaxdist.advise import (Cluster, ModelSpec, ParallelConfig, activation_bytes_per_layer,
                            evaluate, recommend, validate)
from jaxdist.advise import cli as advise_cli
from jaxdist.advise.specs import DIRECTORY, presets
from helpers import assert_trees_close, serial, to_host

GB = 1e9
MEGATRON = json.loads((DIRECTORY / "megatron_lm_2021.json").read_text())


@pytest.mark.parametrize("stage,expected_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states_7_5b_at_dp64(stage, expected_gb):
  """Rajbhandari et al. 2019 (ZeRO), Figure 1: 7.5B parameters, mixed-precision Adam,
  N_d = 64: 120 / 31.4 / 16.6 / 1.9 GB of model states per device for stages 0-3."""
  model = ModelSpec.from_params(7.5)
  assert model.num_params == 7.5e9
  e = evaluate(model, Cluster(64, 8, "a100-80gb"), ParallelConfig(dp=64, zero_stage=stage),
               global_batch_size=64)
  states = e.memory["params"] + e.memory["grads"] + e.memory["optimizer"]
  assert states / GB == pytest.approx(expected_gb, abs=0.05)


def test_korthikanti_activation_formulas_for_a_gpt_layer():
  """Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer
  Models', Table 2: bytes per layer for s, b, h, a, t."""
  s, b, h, a, t = 2048, 4, 3072, 24, 8
  model = ModelSpec(num_layers=4, hidden_size=h, num_heads=a, seq_len=s)
  sbh = s * b * h
  for kwargs, expected in [
      (dict(), sbh * (34 + 5 * a * s / h)),
      (dict(tp=t), sbh * (10 + 24 / t + 5 * a * s / (h * t))),
      (dict(tp=t, sequence_parallel=True), sbh * (34 + 5 * a * s / h) / t),
      (dict(tp=t, sequence_parallel=True, recompute="selective"), 34 * sbh / t),
      (dict(tp=t, recompute="selective"), sbh * (10 + 24 / t)),
      (dict(recompute="full"), 2 * sbh),
      (dict(tp=t, sequence_parallel=True, recompute="full"), 2 * sbh / t)]:
    assert activation_bytes_per_layer(model, b, **kwargs) == pytest.approx(expected), kwargs


@pytest.mark.parametrize("name", presets())
def test_preset_parameter_counts_match_published_within_2_percent(name):
  """Each preset's public count (sources in strategies/advise/models.json)."""
  model = ModelSpec.from_preset(name)
  assert model.num_params == pytest.approx(model.published_params, rel=0.02)
  if model.published_active_params:
    assert model.active_params == pytest.approx(model.published_active_params, rel=0.02)


def test_hugging_face_configs_give_the_preset_counts():
  """config.json fields of meta-llama/Llama-3.1-8B, mistralai/Mixtral-8x7B-v0.1,
  deepseek-ai/DeepSeek-V3, Qwen/Qwen2.5-72B and gpt2 (124,439,808 parameters)."""
  llama = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False}
  assert ModelSpec.from_hf_config(llama).num_params == 8030261248
  mixtral = dict(llama, model_type="mixtral", vocab_size=32000, num_local_experts=8,
                 num_experts_per_tok=2)
  assert ModelSpec.from_hf_config(mixtral).num_params == 46702792704
  qwen = dict(llama, model_type="qwen2", num_hidden_layers=80, hidden_size=8192,
              num_attention_heads=64, intermediate_size=29568, vocab_size=152064)
  assert ModelSpec.from_hf_config(qwen).num_params == pytest.approx(72.7e9, rel=0.01)
  v3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
        "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 129280, "max_position_embeddings": 163840}
  assert ModelSpec.from_hf_config(v3).num_params == ModelSpec.from_preset("deepseek-v3").num_params
  gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
          "n_positions": 1024, "n_inner": None}
  assert ModelSpec.from_hf_config(gpt2).num_params == 124439808
  with pytest.raises(errors.InvalidArgumentError, match="model_type='bloom'"):
    ModelSpec.from_hf_config({"model_type": "bloom"})


def _megatron(row):
  model = ModelSpec(num_layers=row["layers"], hidden_size=row["hidden"], num_heads=row["heads"],
                    vocab_size=MEGATRON["vocab_size"], seq_len=MEGATRON["seq_len"])
  return model, Cluster(row["gpus"], 8, MEGATRON["device"])


@pytest.mark.parametrize("row", MEGATRON["rows"], ids=lambda r: f"{r['params_b']}B")
def test_megatron_lm_2021_table_configs_fit_a100_80gb_and_predict_its_tflops(row):
  """Narayanan et al. 2021, Table 1: the paper's (tp, pp) on its GPU count, micro-batch 1,
  full recomputation, no sequence parallelism (it came later): valid, fits in 80 GB, and
  the predicted TFLOP/s per GPU (the paper's counting) within 20% of the reported one."""
  model, cluster = _megatron(row)
  # The table rounds to 0.1B (1.65B is listed as 1.7).
  assert model.num_params / 1e9 == pytest.approx(row["params_b"], abs=0.05)
  config = ParallelConfig(dp=row["gpus"] // (row["tp"] * row["pp"]), tp=row["tp"], pp=row["pp"],
                          recompute="full", sequence_parallel=False)
  e = evaluate(model, cluster, config, global_batch_size=row["batch"])
  assert e.valid and e.fits, e.problems
  assert e.tflops_per_device == pytest.approx(row["tflops_per_gpu"], rel=0.2)


@pytest.mark.parametrize("index", [3, 4], ids=["18.4B-256", "39.1B-512"])
def test_megatron_rows_recommendation_keeps_tp_in_a_node_and_matches_the_paper(index):
  """Narayanan et al. 2021, Table 1: for the 18.4B (256 GPUs) and 39.1B (512 GPUs) rows
  the advisor's best keeps tensor parallelism inside the 8-GPU node, fits, and is
  predicted at least as fast as the paper's configuration (which the search also finds)."""
  row = MEGATRON["rows"][index]
  model, cluster = _megatron(row)
  advice = recommend(model, cluster, global_batch_size=row["batch"], top_k=5000)
  best = advice.best
  assert best.config.tp <= 8 and best.fits and best.valid
  paper = [e for e in advice.candidates
           if (e.config.tp, e.config.pp, e.config.micro_batch_size, e.config.recompute,
               e.config.zero_stage, e.config.virtual_stages) == (row["tp"], row["pp"], 1, "full", 0, 1)]
  assert paper, "the paper's configuration is not among those that fit"
  assert best.tokens_per_s >= paper[0].tokens_per_s
  assert best.tflops_per_device >= 0.8 * row["tflops_per_gpu"]


def test_nemo_training_days_rule_reproduces_narayanan_estimates():
  """Narayanan et al. 2021, section 5.1: GPT-3 175B on 300B tokens, 1024 A100s at
  140 TFLOP/s: 34 days; 1T parameters on 450B tokens, 3072 A100s at 163 TFLOP/s: 84 days
  (their 8·T·P/(n·X), which is NeMo's Auto Configurator rule)."""
  assert jd.advise.training_days(175e9, 300e9, 1024, 140) == pytest.approx(34, abs=0.5)
  assert jd.advise.training_days(1008e9, 450e9, 3072, 163) == pytest.approx(84, abs=0.5)
  n = jd.advise.model_size(34, 300e9, 1024, 140)
  assert jd.advise.training_days(n, 300e9, 1024, 140) == pytest.approx(34)
  with pytest.raises(errors.InvalidArgumentError, match="num_devices=0"):
    jd.advise.training_days(1e9, 1e9, 0, 100)


def test_memory_follows_the_parallel_dimensions():
  model = ModelSpec.from_preset("llama-2-13b")
  cluster = Cluster(16)

  def mem(**kw):
    return evaluate(model, cluster, ParallelConfig(**kw), global_batch_size=64).memory

  base = mem(dp=16)
  assert mem(dp=8, tp=2)["params"] == pytest.approx(base["params"] / 2, rel=0.01)
  assert mem(dp=16, zero_stage=3)["params"] == pytest.approx(base["params"] / 16)
  assert mem(dp=16, recompute="full")["activations"] < mem(dp=16, recompute="selective")["activations"] < base["activations"]
  # 1F1B: the first stage holds pp micro-batches of its layers; GPipe all of them.
  one = mem(dp=4, pp=4)["activations"]
  gpipe = evaluate(model, cluster, ParallelConfig(dp=4, pp=4, schedule="gpipe"),
                   global_batch_size=64).memory["activations"]
  assert gpipe > one
  e = evaluate(model, cluster, ParallelConfig(dp=4, pp=4), global_batch_size=64)
  assert e.bubble_fraction == pytest.approx(3 / (16 + 3))
  assert e.step_time_bounds[0] <= e.step_time_bounds[1]
  assert 0 < e.mfu < 1 and e.tokens_per_s > 0 and e.cost_per_million_tokens > 0


def test_every_rule_is_reported_with_its_fix():
  model = ModelSpec.from_preset("mixtral-8x7b")
  cluster = Cluster(16)
  bad = ParallelConfig(dp=1, tp=16, pp=3, cp=2, ep=3, zero_stage=2, micro_batch_size=3,
                       virtual_stages=2)
  problems = validate(model, cluster, bad, global_batch_size=100)
  text = "\n".join(problems)
  for rule in ("devices:", "tp inside a node", "layers % (pp*v)", "global batch % (mbs*dp)",
               "experts % ep", "ep divides dp", "cp and ep not both", "ZeRO-2 with pipelining"):
    assert rule in text, (rule, problems)
  assert all("; " in p for p in problems)  # each says what to do
  assert validate(model, cluster, ParallelConfig(dp=8, tp=2), global_batch_size=64) == []
  heads = validate(ModelSpec.from_preset("gpt3-13b"), cluster, ParallelConfig(dp=1, tp=16),
                   global_batch_size=64)
  assert any(p.startswith("heads % tp: 40 attention heads") and "[1, 2, 4, 5, 8" in p for p in heads)


def test_user_errors_are_typed_and_name_the_value():
  with pytest.raises(errors.InvalidArgumentError, match=r"tp=0"):
    ParallelConfig(tp=0)
  with pytest.raises(errors.InvalidArgumentError, match=r"recompute='some'.*'selective'"):
    ParallelConfig(recompute="some")
  with pytest.raises(errors.InvalidArgumentError, match=r"device='v100'.*h100-80gb"):
    Cluster(8, device="v100")
  with pytest.raises(errors.InvalidArgumentError, match=r"'llama-9'.*llama-3.1-8b"):
    ModelSpec.from_preset("llama-9")
  model = ModelSpec.from_preset("llama-3.1-8b")
  with pytest.raises(errors.UnknownArgumentError, match=r"\['tensor_parallel'\]"):
    recommend(model, Cluster(8), global_batch_size=8, tensor_parallel=2)
  with pytest.raises(errors.InvalidArgumentError, match=r"objective='speed'"):
    recommend(model, Cluster(8), global_batch_size=8, objective="speed")
  with pytest.raises(errors.InvalidArgumentError, match=r"global_batch_size=0"):
    evaluate(model, Cluster(8), ParallelConfig(dp=8), global_batch_size=0)
  with pytest.raises(errors.InvalidArgumentError, match=r"precision='int4'"):
    evaluate(model, Cluster(8), ParallelConfig(dp=8), global_batch_size=8, precision="int4")


def test_recommend_ranks_explains_and_finds_the_pareto_front(tmp_path):
  model = ModelSpec.from_preset("mixtral-8x7b")
  cluster = Cluster(32, 8, "h100-80gb")
  advice = recommend(model, cluster, global_batch_size=256, seq_len=4096, top_k=5)
  assert 0 < len(advice.candidates) <= 5 and advice.evaluated > 50
  speeds = [e.tokens_per_s for e in advice.candidates]
  assert speeds == sorted(speeds, reverse=True)
  assert all(e.fits and e.valid and e.config.num_devices == 32 for e in advice.candidates)
  assert all(not e.fits for e in advice.rejected) and advice.rejected
  assert "does not" not in advice.explain(advice.best) and advice.explain(advice.best) == "best"
  assert "x the best's step time" in advice.explain(advice.candidates[1])
  assert "GiB per device is" in advice.explain(advice.rejected[0])
  assert any(e.config.ep > 1 for e in advice._all_fitting)  # experts split somewhere
  advice.to_csv(tmp_path / "advice.csv")
  rows = list(csv.DictReader(open(tmp_path / "advice.csv")))
  assert rows[0]["rank"] == "1" and float(rows[0]["tokens_per_s"]) == pytest.approx(speeds[0])
  days = advice.training_days(1e12)
  assert days == pytest.approx(1e12 / advice.best.tokens_per_s / 86400)

  cheap = recommend(model, cluster, global_batch_size=256, seq_len=4096, objective="cost")
  front = cheap.pareto("cost")
  assert front and front[0].tokens_per_s == max(e.tokens_per_s for e in cheap._all_fitting)
  for a, b in zip(front, front[1:]):  # slower points of the front must be cheaper
    assert b.tokens_per_s <= a.tokens_per_s and b.cost_per_million_tokens < a.cost_per_million_tokens
  assert cheap.best.cost_per_million_tokens == min(e.cost_per_million_tokens for e in front)
  assert len({e.config.num_devices for e in cheap._all_fitting}) > 1
  by_devices = cheap.pareto("devices")
  assert [e.config.num_devices for e in by_devices] == sorted(
      (e.config.num_devices for e in by_devices), reverse=True)


def test_recommend_respects_constraints():
  model = ModelSpec.from_preset("llama-2-70b")
  advice = recommend(model, Cluster(64), global_batch_size=256, tp=8, recompute="full",
                     max_model_parallel=16)
  assert advice.candidates
  assert all(e.config.tp == 8 and e.config.recompute == "full"
             and e.config.model_parallel <= 16 for e in advice.candidates)
  cross = recommend(model, Cluster(64), global_batch_size=256, tp=16, allow_cross_node_tp=True)
  assert all(e.config.tp == 16 for e in cross.candidates + cross.rejected)
  assert not recommend(model, Cluster(64), global_batch_size=256, tp=16).evaluated


def _tiny_gpt():
  config = models.GPTConfig(vocab=128, width=32, heads=4, depth=2, seq_len=16)
  batch = models.token_batch(16, config)
  state = models.create_state(models.GPT(config), batch["tokens"][:, :-1],
                              tx=optax.sgd(0.1, momentum=0.9))
  spec = ModelSpec(num_layers=2, hidden_size=32, num_heads=4, vocab_size=128, seq_len=16)
  return state, batch, spec


@pytest.mark.parametrize("config,kind", [
    (ParallelConfig(dp=8), "DataParallel"),
    (ParallelConfig(dp=8, zero_stage=2, micro_batch_size=1), "Zero2Parallel"),
    (ParallelConfig(dp=4, tp=2, micro_batch_size=2), "ShardParallel"),
    (ParallelConfig(dp=4, pp=2, micro_batch_size=1), "PipeshardParallel"),
], ids=["dp", "zero2-accumulate", "dp4-tp2", "pp2"])
def test_the_recommended_method_runs_and_matches_serial(config, kind):
  state, batch, spec = _tiny_gpt()
  e = evaluate(spec, Cluster(8), config, global_batch_size=16)
  assert e.valid, e.problems
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # nothing folded away for these
    method = e.method(layer_module="Block")
  assert type(method).__name__ == kind
  if kind == "ShardParallel":
    assert method.devices.shape == (4, 2) and method.devices.axis_names == ("data", "model")
    assert any("query" in k for k in method.options.partition_constraints)
  step = models.lm_step(jd.value_and_grad)
  expected = to_host(serial(step, state, batch))
  got = to_host(jd.parallelize(step, method=method)(state, batch))
  assert_trees_close(got, expected, rtol=1e-4, atol=1e-6)


def test_interleaved_stages_become_virtual_stages():
  """pp=2 with virtual_stages=2: PipeshardParallel with four uniform stages on two device
  groups (its run is tested in test_pipeline.py), nothing folded away."""
  spec = ModelSpec(num_layers=4, hidden_size=32, num_heads=4, vocab_size=128, seq_len=16)
  e = evaluate(spec, Cluster(8), ParallelConfig(dp=4, pp=2, virtual_stages=2), global_batch_size=16)
  assert e.valid, e.problems
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    method = e.method(layer_module="Block")
  assert (method.virtual_stages, method.stage_option.num_stages) == (2, 4)
  assert method.num_micro_batches % 2 == 0
  assert "virtual_stages=2" in jd.advise.python_code(e)


def test_what_jaxdist_cannot_run_is_folded_with_a_warning():
  state, batch, spec = _tiny_gpt()
  e = evaluate(spec, Cluster(8), ParallelConfig(dp=4, cp=2), global_batch_size=16, seq_len=16)
  with pytest.warns(errors.JaxdistWarning, match="no context parallelism"):
    method = e.method()
  assert type(method).__name__ == "DataParallel"


def test_launch_outputs_for_a_two_node_configuration():
  model = ModelSpec.from_preset("llama-3.1-8b")
  e = evaluate(model, Cluster(16), ParallelConfig(dp=4, tp=4, zero_stage=1),
               global_batch_size=64)
  code = jd.advise.python_code(e)
  compile(code, "<advise>", "exec")  # valid Python
  assert "jd.LogicalMesh((4, 4)" in code and "megatron_attention" in code
  assert "prefer_reduce_scatter=True" in code and "jd.init_distributed()" in code
  hosts = jd.advise.host_env(e, "10.0.0.1:4321")
  assert [h["JAX_PROCESS_ID"] for h in hosts] == ["0", "1"]
  assert all(h["JAX_NUM_PROCESSES"] == "2" and h["JAX_COORDINATOR_ADDRESS"] == "10.0.0.1:4321"
             for h in hosts)
  script = jd.advise.slurm_script(e, "train.py", partition="gpu")
  for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
               "export JAX_NUM_PROCESSES=2", "srun --ntasks=2"):
    assert line in script, line
  assert jd.advise.local_command(e) == (
      "python -m jaxdist.launch --num-processes 2 --devices-per-process 8 -- python train.py")
  # Planning for a cluster this process is not on: the method carries the shape only.
  method = e.method(layer_module="Block")
  assert method.logical_mesh_shape == (4, 4)


def test_cli_recommend_validate_and_presets(capsys, tmp_path):
  out = tmp_path / "advice.csv"
  assert advise_cli.main(["recommend", "--model", "llama-3.1-70b", "--gpus", "16",
                          "--gpus-per-node", "8", "--gpu", "h100-80gb", "--global-batch", "512",
                          "--seq", "4096", "--top", "3", "--json", "--csv", str(out)]) == 0
  rows = json.loads(capsys.readouterr().out)
  assert len(rows) == 3 and rows[0]["why"] == "best" and rows[0]["fits"]
  assert out.read_text().startswith("model,")
  assert advise_cli.main(["validate", "--model", "gpt3-13b", "--gpus", "16", "--global-batch",
                          "64", "--tp", "16"]) == 1
  assert "heads % tp" in capsys.readouterr().out
  assert advise_cli.main(["presets", "--json"]) == 0
  listed = json.loads(capsys.readouterr().out)
  assert "llama-3.1-405b" in listed["models"] and "tpu-v5p" in listed["devices"]
  assert advise_cli.main(["slurm", "--model", "7.5B", "--gpus", "16", "--global-batch", "64",
                          "--tp", "2"]) == 0
  assert "#SBATCH --nodes=2" in capsys.readouterr().out
  assert advise_cli.main(["days", "--model", "gpt3-175b", "--tokens", "300e9", "--gpus", "1024",
                          "--tflops", "140", "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["days"] == pytest.approx(33.9, abs=0.1)
  assert advise_cli.main(["memory", "--model", "nope", "--gpus", "8", "--global-batch", "8"]) == 2
  assert "--model 'nope'" in capsys.readouterr().err


def test_topology_reads_the_present_devices():
  info = jd.advise.topology()
  assert info["num_devices"] == 8 and info["platform"] == "cpu"
  assert info["preset_is_a_stand_in"]
  assert jd.advise.Cluster.detect().num_devices == 8


def test_dry_run_compiles_the_width_and_prints_both_figures():
  """A GPT-3 125M-wide model, 1 layer, dp2 on 2 simulated devices (subprocess)."""
  from jaxdist.advise.dry_run import dry_run

  model = ModelSpec.from_preset("gpt3-125m", seq_len=256)
  e = evaluate(model, Cluster(2), ParallelConfig(dp=2, micro_batch_size=2), global_batch_size=4)
  result = dry_run(e, num_layers=1)
  assert result["compiled"]["method"] == "DataParallel"
  assert result["compiled_bytes"] > 0 and result["estimate_bytes"] > 0
  assert 0.5 < result["ratio"] < 2, result["text"]
  assert "advisor formula" in result["text"] and "XLA compiled" in result["text"]
