"""The advisor against the Megatron-LM 2021 weak-scaling table, and its memory formula
against XLA (dry runs).

Part 1, for each row of Narayanan et al. 2021, Table 1 (A100 80GB, seq 2048, V 51200):
the paper's configuration (tp, pp, dp, micro-batch 1, full recomputation) as the advisor
predicts it (fits? TFLOP/s per GPU against the reported), and the advisor's own best
configuration for the same model, GPUs and batch. Claims: every paper configuration is
valid and fits; its predicted TFLOP/s is within 20% of the reported; the advisor's best
keeps tp inside a node and is predicted at least as fast as the paper's configuration.

Part 2: ``jaxdist advise dry-run`` on a few widths: the formula's bytes per device next to
XLA's compiled bytes for the same few-layer model and configuration (fp32 Adam on CPU;
the formula assumes fused GPU kernels, so this shows how far that assumption is from
what XLA:CPU does).

Run: python bench/advise.py [--skip-dry-run]
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxdist.advise import Cluster, ModelSpec, ParallelConfig, evaluate, recommend  # noqa: E402
from jaxdist.advise.dry_run import dry_run  # noqa: E402
from jaxdist.advise.specs import DIRECTORY  # noqa: E402


def verdict(ok: bool) -> str:
  return "PASS" if ok else "FAIL"


def megatron() -> bool:
  table = json.loads((DIRECTORY / "megatron_lm_2021.json").read_text())
  print("Megatron-LM 2021, Table 1 (A100 80GB): paper config vs advisor")
  print(f"{'model':>8} {'GPUs':>5} {'paper tp/pp':>11} {'GiB':>5} {'pred TF':>7} {'paper TF':>8} "
        f"{'ratio':>5}   {'advisor best':<44} {'GiB':>5} {'pred TF':>7} {'s':>5}")
  ok = True
  for r in table["rows"]:
    model = ModelSpec(num_layers=r["layers"], hidden_size=r["hidden"], num_heads=r["heads"],
                      vocab_size=table["vocab_size"], seq_len=table["seq_len"],
                      name=f"{r['params_b']}B")
    cluster = Cluster(r["gpus"], 8, table["device"])
    paper = evaluate(model, cluster, ParallelConfig(
        dp=r["gpus"] // (r["tp"] * r["pp"]), tp=r["tp"], pp=r["pp"], recompute="full",
        sequence_parallel=False), global_batch_size=r["batch"])
    start = time.perf_counter()
    best = recommend(model, cluster, global_batch_size=r["batch"], top_k=1).best
    seconds = time.perf_counter() - start
    ratio = paper.tflops_per_device / r["tflops_per_gpu"]
    row_ok = (paper.valid and paper.fits and abs(ratio - 1) <= 0.2 and best is not None
              and best.config.tp <= 8 and best.tokens_per_s >= paper.tokens_per_s)
    ok &= row_ok
    print(f"{r['params_b']:>7}B {r['gpus']:>5} {r['tp']:>6}/{r['pp']:<4} "
          f"{paper.memory['total'] / 2**30:>5.1f} {paper.tflops_per_device:>7.0f} "
          f"{r['tflops_per_gpu']:>8} {ratio:>5.2f}   {best.config.label():<44} "
          f"{best.memory['total'] / 2**30:>5.1f} {best.tflops_per_device:>7.0f} {seconds:>5.2f}"
          f"  {verdict(row_ok)}")
  return ok


def dry_runs() -> None:
  print("\nDry runs: the advisor's bytes per device vs XLA's for the same model (2 layers)")
  cases = [("gpt3-125m", 8, ParallelConfig(dp=8, micro_batch_size=4), 1024),
           ("gpt3-1.3b", 8, ParallelConfig(dp=8, micro_batch_size=1), 2048),
           ("gpt3-1.3b", 8, ParallelConfig(dp=8, micro_batch_size=1, recompute="full"), 2048),
           ("gpt3-1.3b", 8, ParallelConfig(dp=4, tp=2, micro_batch_size=1), 2048),
           ("llama-3.1-8b", 4, ParallelConfig(dp=2, tp=2, micro_batch_size=1), 2048)]
  for name, n, config, seq in cases:
    e = evaluate(ModelSpec.from_preset(name, seq_len=seq), Cluster(n), config,
                 global_batch_size=config.dp * config.micro_batch_size)
    result = dry_run(e, num_layers=2)
    print(result["text"])


if __name__ == "__main__":
  ok = megatron()
  print(f"\nMegatron rows: {verdict(ok)}")
  if "--skip-dry-run" not in sys.argv:
    dry_runs()
