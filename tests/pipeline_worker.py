"""Run under `python -m jaxdist.launch` with 2 processes x 4 devices: a GPT pipelined in two
stages, one per process (model boundaries, 1F1B, 2 micro-batches; the optimizer clips by
the global norm, so the stages' updates share a norm); every process prints the
losses of two steps (the loss is made on the last stage, process 1, and comes back readable
on every process) and the sum of every parameter after them, gathered onto all devices
(every process gathers; each reads its own copy), and the loss of an evaluation step that
follows the pipeline, on the gathered state.

With the argument ``spmd``, only the same two steps under the SPMD runtime (one program
over a (2 stages, 4 data) mesh, a stage per process, GPipe); with ``tied``, only a GPT
with a tied embedding on three unequal stages (4 | 2 + 2 devices)."""

import dataclasses
import json
import sys

import jaxdist as jd

jd.init_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxdist import models  # noqa: E402

config = models.GPTConfig(vocab=64, width=16, heads=2, depth=2, seq_len=16, mark_boundaries=True)
batch = models.token_batch(16, config)
# Clipping by the global norm: each stage's update reads a norm over both stages.
tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1, momentum=0.9))

def tied_embedding_pipeline():
  """A model whose output layer reuses the input embedding, on stages of unequal sizes
  across the processes: the embedding is read by the first and last stages, lives on
  all devices and sums both stages' gradients across the processes. Its losses and the
  embedding's sum after 2 steps."""
  tied = models.GPT(dataclasses.replace(config, tied_embedding=True))
  tied_state = models.create_state(tied, batch["tokens"][:, :-1], tx=optax.sgd(0.1, momentum=0.9))
  # Unequal stages: embedding + block 0 on process 0's 4 devices, block 1 and the head on
  # 2 devices each of process 1.
  stages = jd.ManualStageOption(forward_stage_layer_ids=[[0, 1], [2], [3]],
                                submesh_shapes=[(4,), (2,), (2,)])
  tied_step = jd.parallelize(models.lm_step(jd.value_and_grad), method=jd.PipeshardParallel(
      num_micro_batches=2, stage_option=stages))
  out = []
  for _ in range(2):
    tied_state, metrics = tied_step(tied_state, batch)
    out.append(float(metrics["loss"]))
  embedding = tied_step.get_executable(tied_state, batch).gather(tied_state.params)
  table = embedding["params"]["Embed_0"]["embedding"]
  layout = [(len(st.mesh.devices), sorted({d.process_index for d in st.mesh.devices}))
            for st in tied_step.get_executable(tied_state, batch).stages]
  return out, float(np.asarray(table.addressable_data(0)).sum()), layout


def spmd_pipeline():
  """The losses of two steps under the SPMD runtime, every parameter's sum after them, and
  the mesh it ran on."""
  state = models.create_state(models.GPT(config), batch["tokens"][:, :-1], tx=tx)
  spmd = jd.parallelize(models.lm_step(jd.value_and_grad), method=jd.PipeshardParallel(
      num_micro_batches=2, pipeline_schedule="gpipe", runtime="spmd"))
  losses = []
  for _ in range(2):
    state, metrics = spmd(state, batch)
    losses.append(float(metrics["loss"]))
  replicated = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices(), ("all",)),
                                          jax.sharding.PartitionSpec())
  sums = jax.jit(lambda tree: [x.sum() for x in jax.tree.leaves(tree)],
                 out_shardings=replicated)(state.params)
  return (losses, [float(x.addressable_data(0)) for x in sums],
          list(spmd.get_executable(state, batch).plan.mesh_shape))


if sys.argv[1:] == ["spmd"]:
  spmd_losses, spmd_sums, spmd_mesh = spmd_pipeline()
  print("RESULT " + json.dumps({"spmd_losses": spmd_losses, "spmd_param_sums": spmd_sums,
                                "spmd_mesh": spmd_mesh}))
  sys.exit(0)

if sys.argv[1:] == ["tied"]:
  tied_losses, tied_sum, tied_stages = tied_embedding_pipeline()
  print("RESULT " + json.dumps({"tied_losses": tied_losses, "tied_embedding_sum": tied_sum,
                                "tied_stages": tied_stages}))
  sys.exit(0)

state = models.create_state(models.GPT(config), batch["tokens"][:, :-1], tx=tx)
step = jd.parallelize(models.lm_step(jd.value_and_grad), method=jd.PipeshardParallel(
    num_micro_batches=2, stage_option=jd.UniformStageOption(num_stages=2)))
exe = step.get_executable(state, batch)
losses = []
for _ in range(2):
  state, metrics = exe(state, batch)
  assert metrics["loss"].sharding.device_set == set(jax.devices())
  losses.append(float(metrics["loss"]))
# Each stage's parameters and momenta stay on its process's devices.
spread = [jax.tree_util.keystr(path) for path, x in
          jax.tree_util.tree_leaves_with_path((state.params, state.opt_state))
          if x.ndim and len(x.sharding.device_set) != 4]
assert not spread, spread
gathered = exe.gather(state.params)  # every process, in the same order
param_sums = [float(np.asarray(x.addressable_data(0)).sum()) for x in jax.tree.leaves(gathered)]
assert all(x.sharding.device_set == set(jax.devices()) for x in jax.tree.leaves(gathered))
stage_processes = [sorted({d.process_index for d in st.mesh.devices}) for st in exe.stages]
# The stages whose programs this process compiled (another process's stage only makes
# placeholders here).
compiled_stages = [s for s, st in enumerate(exe.stages)
                   if getattr(st.forward, "_compiled", True) is not None
                   or getattr(st.backward, "_compiled", True) is not None]


def eval_fn(state, batch):
  tokens = batch["tokens"]
  logits = state.apply_fn(state.params, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# An evaluation step that follows the pipeline, on the state gathered onto all devices.
evaluate = jd.parallelize(eval_fn, method=jd.FollowParallel(step))
eval_loss = float(evaluate(exe.gather(state), batch))
print("RESULT " + json.dumps({"losses": losses, "stage_processes": stage_processes,
                              "compiled_stages": compiled_stages,
                              "eval_loss": eval_loss, "param_sums": param_sums}))
