"""From a configuration to running code: the jaxdist method object, the same as Python
source, each host's ``jax.distributed`` environment, a SLURM batch script, and a
``python -m jaxdist.launch`` line for a local dry run on simulated CPU devices.

A configuration maps to jaxdist's methods as follows: no model parallelism →
DataParallel (ZeRO-0), Zero2Parallel (ZeRO-1 and 2: jaxdist shards gradients and optimizer
state together) or Zero3Parallel; tensor or expert parallelism → ShardParallel on a
``(data, model)`` logical mesh with the Megatron attention (or expert) partition-constraint
preset of ``strategies/presets`` and the ZeRO stage as planner options; pipelining →
PipeshardParallel with ``pp`` uniform stages of ``(dp, tp)`` sub-meshes. Gradient
accumulation over the configuration's micro-batches becomes ``num_micro_batches``; full
recomputation ``recompute_modules=<layer module>`` (``"ROOT"`` when not given), selective
the attention module; interleaved virtual stages → ``virtual_stages`` (``pp`` device
groups of ``virtual_stages`` stages each). What jaxdist cannot express (context
parallelism) is folded into data parallelism with a note.
"""

from __future__ import annotations

import dataclasses
import shlex
import warnings
from typing import Any

from jaxdist import errors

PRESET_OF = {"tp": "megatron_attention", "ep": "expert_parallel"}


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  """One data type between the advisor and both renderings (object and source)."""

  cls: str
  kwargs: dict[str, Any]
  mesh: tuple[int, int] | None = None
  alpha: tuple[float, float] | None = None
  beta: tuple[float, float] | None = None
  preset: str | None = None
  sharding: dict[str, Any] = dataclasses.field(default_factory=dict)
  stages: int | None = None
  notes: tuple[str, ...] = ()


def method_spec(e, *, layer_module: str | None = None,
                attention_module: str = "MultiHeadDotProductAttention") -> MethodSpec:
  c, cluster = e.config, e.cluster
  notes = []
  dp = c.dp * c.cp
  if c.cp > 1:
    notes.append(f"jaxdist has no context parallelism: cp={c.cp} runs as {c.cp}x more data "
                 f"parallelism (dp={dp}); activations per device grow by cp")
  if c.virtual_stages > 1 and c.pp == 1:
    notes.append(f"virtual_stages={c.virtual_stages} without pipelining (pp=1) has no effect")
  m = c.num_micro_batches(e.global_batch_size)
  recompute = {"none": None, "full": layer_module or "ROOT", "selective": attention_module}[c.recompute]
  kwargs: dict[str, Any] = {"num_micro_batches": m if m > 1 else None,
                            "recompute_modules": recompute}
  sharding = {}
  if c.zero_stage in (1, 2):
    sharding["prefer_reduce_scatter"] = True
  if c.zero_stage == 3:
    sharding["force_zero_stage_3"] = True
  model_axis = c.tp * (c.ep if c.tp == 1 else 1)
  if c.ep > 1 and c.tp > 1:
    notes.append("tp and ep together: the mesh's model axis carries tp; the planner places the "
                 "experts")
  span_model = cluster.link(model_axis)
  span_data = cluster.link(dp * model_axis)
  alpha, beta = (span_data[0], span_model[0]), (1 / span_data[1], 1 / span_model[1])
  if c.pp > 1:
    kwargs["num_micro_batches"] = m
    if c.virtual_stages > 1:  # interleaved 1F1B: pp device groups, virtual_stages chunks each
      kwargs["virtual_stages"] = c.virtual_stages
    return MethodSpec("PipeshardParallel", kwargs, mesh=(dp, c.tp), alpha=alpha, beta=beta,
                      preset=PRESET_OF["tp"] if c.tp > 1 else None, sharding=sharding,
                      stages=c.pp * c.virtual_stages, notes=tuple(notes))
  if model_axis == 1:
    cls = {0: "DataParallel", 1: "Zero2Parallel", 2: "Zero2Parallel", 3: "Zero3Parallel"}[c.zero_stage]
    return MethodSpec(cls, kwargs, notes=tuple(notes))
  preset = PRESET_OF["tp"] if c.tp > 1 else PRESET_OF["ep"]
  return MethodSpec("ShardParallel", kwargs, mesh=(dp // (c.ep if c.tp == 1 else 1), model_axis),
                    alpha=alpha, beta=beta, preset=preset, sharding=sharding, notes=tuple(notes))


def _constraints(preset: str | None) -> dict:
  if preset is None:
    return {}
  from jaxdist.tune.presets import load_presets

  return next(p.constraints for p in load_presets() if p.name == preset)


def method_for(e, *, layer_module: str | None = None,
               attention_module: str = "MultiHeadDotProductAttention"):
  """The method object. Its logical mesh is built when this process sees the
  configuration's device count; elsewhere (planning for a cluster you are not on) the
  method carries ``logical_mesh_shape`` and the device kind's default link costs."""
  import jax

  import jaxdist as jd

  spec = method_spec(e, layer_module=layer_module, attention_module=attention_module)
  for note in spec.notes:
    warnings.warn(note, errors.JaxdistWarning, stacklevel=3)
  kwargs = dict(spec.kwargs)
  if spec.cls in ("DataParallel", "Zero2Parallel", "Zero3Parallel"):
    return getattr(jd, spec.cls)(**kwargs)
  here = len(jax.devices()) == e.config.num_devices
  constraints = _constraints(spec.preset)
  option = jd.AutoShardingOption(partition_constraints=constraints or None,
                                 force_batch_dim_to_mesh_dim=0, **spec.sharding)
  if spec.cls == "PipeshardParallel":
    return jd.PipeshardParallel(
        layer_option=jd.AutoLayerOption(layer_num=spec.stages),
        stage_option=jd.UniformStageOption(num_stages=spec.stages, submesh_shape=spec.mesh),
        default_auto_sharding_option=option, **kwargs)
  if here:
    kwargs["devices"] = jd.LogicalMesh(spec.mesh, axis_names=("data", "model"),
                                       alpha=spec.alpha, beta=spec.beta)
  else:
    kwargs["logical_mesh_shape"] = spec.mesh
    # Without a LogicalMesh the axes are named mesh_0, mesh_1.
    option = dataclasses.replace(option, partition_constraints={
        k: jax.sharding.PartitionSpec(*("mesh_1" if a == "model" else a for a in v))
        for k, v in constraints.items()} or None)
  return jd.ShardParallel(auto_sharding_option=option, **kwargs)


def python_code(e, *, layer_module: str | None = None,
                attention_module: str = "MultiHeadDotProductAttention") -> str:
  """Python source that sets up the method on the cluster (every host runs it)."""
  spec = method_spec(e, layer_module=layer_module, attention_module=attention_module)
  args = [f"{k}={v!r}" for k, v in spec.kwargs.items() if v is not None]
  lines = ["import jaxdist as jd", "", "jd.init_distributed()  # every host, before any computation"]
  lines += [f"# note: {n}" for n in spec.notes]
  if spec.cls in ("DataParallel", "Zero2Parallel", "Zero3Parallel"):
    lines.append(f"method = jd.{spec.cls}({', '.join(args)})")
  else:
    opt = ["force_batch_dim_to_mesh_dim=0"] + [f"{k}={v!r}" for k, v in spec.sharding.items()]
    if spec.preset:
      lines.insert(1, "from jaxdist.tune.presets import load_presets")
      lines.append(f"constraints = next(p.constraints for p in load_presets()  "
                   f"# strategies/presets/{spec.preset}.json\n"
                   f"                   if p.name == {spec.preset!r})")
      opt.insert(0, "partition_constraints=constraints")
    lines.append(f"option = jd.AutoShardingOption({', '.join(opt)})")
    if spec.cls == "PipeshardParallel":
      lines.append(
          f"method = jd.PipeshardParallel({', '.join(args)},\n"
          f"    layer_option=jd.AutoLayerOption(layer_num={spec.stages}),  # or 'manual' with "
          f"jd.mark_pipeline_boundary()\n"
          f"    stage_option=jd.UniformStageOption(num_stages={spec.stages}, "
          f"submesh_shape={spec.mesh}),\n"
          f"    default_auto_sharding_option=option)")
    else:
      lines.append(f"mesh = jd.LogicalMesh({spec.mesh}, axis_names=('data', 'model'),\n"
                   f"                      alpha={tuple(float(f'{a:.3g}') for a in spec.alpha)}, "
                   f"beta={tuple(float(f'{b:.3g}') for b in spec.beta)})")
      lines.append(f"method = jd.ShardParallel(devices=mesh, auto_sharding_option=option"
                   + "".join(f", {a}" for a in args) + ")")
  lines.append("train_step = jd.parallelize(train_step, method=method)")
  if spec.kwargs.get("num_micro_batches") and spec.cls != "PipeshardParallel":
    lines.append("# gradient accumulation needs jd.grad / jd.value_and_grad inside train_step")
  return "\n".join(lines)


def host_env(e, coordinator: str = "node0:1234") -> list[dict[str, str]]:
  """Per host (one process per node, all its devices): the environment that
  ``jd.init_distributed()`` reads."""
  nodes = e.cluster.with_devices(e.config.num_devices).num_nodes
  return [{"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(nodes),
           "JAX_PROCESS_ID": str(i)} for i in range(nodes)]


def slurm_script(e, script: str = "train.py", *, job_name: str = "jaxdist",
                 partition: str | None = None, time: str = "24:00:00", port: int = 1234) -> str:
  """An ``sbatch`` script: one task per node with all its GPUs, the coordinator on the
  first node (``jax.distributed.initialize()`` detects SLURM by itself; the explicit
  variables make the job's wiring visible)."""
  cluster = e.cluster.with_devices(e.config.num_devices)
  nodes, per = cluster.num_nodes, min(cluster.devices_per_node, e.config.num_devices)
  lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
           "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={per}",
           f"#SBATCH --time={time}", "#SBATCH --exclusive"]
  if partition:
    lines.append(f"#SBATCH --partition={partition}")
  lines += ["", f"# {e.model.name}: {e.config.label()}",
            f"# predicted: {e.step_time_s:.2f} s/step, {e.tokens_per_s:,.0f} tokens/s, "
            f"{e.memory['total'] / 2**30:.1f} GiB/device",
            "set -euo pipefail",
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f'export JAX_COORDINATOR_ADDRESS="$head:{port}"',
            f"export JAX_NUM_PROCESSES={nodes}",
            f"srun --ntasks={nodes} --ntasks-per-node=1 bash -c "
            f"'JAX_PROCESS_ID=$SLURM_PROCID python {shlex.quote(script)}'"]
  return "\n".join(lines) + "\n"


def local_command(e, script: str = "train.py") -> str:
  """Runs the configuration's process layout here on simulated CPU devices."""
  cluster = e.cluster.with_devices(e.config.num_devices)
  nodes, per = cluster.num_nodes, min(cluster.devices_per_node, e.config.num_devices)
  return (f"python -m jaxdist.launch --num-processes {nodes} --devices-per-process {per} "
          f"-- python {shlex.quote(script)}")
