"""``jaxdist advise``: recommend, memory, pareto, launch, slurm, validate, dry-run, presets,
topology, size, days. Tables with rich; ``--json`` for machines."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from jaxdist import errors
from jaxdist.advise import launch
from jaxdist.advise.cluster import Cluster, devices, topology
from jaxdist.advise.config import ParallelConfig, validate
from jaxdist.advise.evaluate import GIB, Evaluation, evaluate
from jaxdist.advise.recommend import recommend
from jaxdist.advise.sizing import model_size, training_days
from jaxdist.advise.specs import ModelSpec, presets

COMMANDS = ("recommend", "memory", "pareto", "launch", "slurm", "validate", "dry-run", "presets",
            "topology", "size", "days")


def parse_model(text: str, seq_len: int | None = None) -> ModelSpec:
  """A preset name, a Hugging Face config.json path, or a parameter count ("7.5B", "350M")."""
  extra = {"seq_len": seq_len} if seq_len else {}
  if text.lower() in presets():
    return ModelSpec.from_preset(text, **extra)
  if Path(text).is_file():
    return ModelSpec.from_hf_config(text, **extra)
  match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([bBmM]?)", text.strip())
  if match:
    scale = {"b": 1.0, "": 1.0, "m": 1e-3}[match.group(2).lower()]
    return ModelSpec.from_params(float(match.group(1)) * scale, **extra)
  raise errors.InvalidArgumentError(
      f"--model {text!r}: give a preset ({', '.join(presets())}), a config.json path, or a "
      f"parameter count such as 7.5B.")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxdist advise",
                                   description="Parallelism, memory, time and cost advice.")
  sub = parser.add_subparsers(dest="command", required=True)

  def common(p, config: bool):
    p.add_argument("--model", required=True, help="preset, config.json path or size (7.5B)")
    p.add_argument("--gpus", type=int, required=True, help="devices in the cluster")
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--gpu", default="h100-80gb", help=f"device preset: {', '.join(devices())}")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp8", "fp32"))
    p.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd", "adafactor"))
    p.add_argument("--json", action="store_true", help="print JSON")
    if config:
      for name in ("dp", "tp", "pp", "cp", "ep"):
        p.add_argument(f"--{name}", type=int, default=None)
      p.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
      p.add_argument("--mbs", type=int, default=1, help="micro-batch size")
      p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
      p.add_argument("--virtual-stages", type=int, default=1)
      p.add_argument("--no-sequence-parallel", action="store_true")

  rec = sub.add_parser("recommend", help="rank the configurations that fit")
  common(rec, config=False)
  rec.add_argument("--objective", default="throughput", choices=("throughput", "cost"))
  rec.add_argument("--top", type=int, default=10)
  rec.add_argument("--csv", default=None, help="write every evaluated configuration")
  rec.add_argument("--allow-cross-node-tp", action="store_true")
  par = sub.add_parser("pareto", help="throughput vs cost per million tokens (smaller clusters too)")
  common(par, config=False)
  par.add_argument("--against", default="cost", choices=("cost", "devices"))
  par.add_argument("--plot", default=None, help="write the front as PNG")
  par.add_argument("--csv", default=None)
  for name, text in (("memory", "memory per device and step time of one configuration"),
                     ("validate", "every rule a configuration breaks, with the fix"),
                     ("launch", "jaxdist code, host environment and a local dry-run line "
                                "(default: the recommended configuration)"),
                     ("slurm", "a SLURM batch script (default: the recommended configuration)"),
                     ("dry-run", "compile the model family at this width with few layers on "
                                 "simulated devices; XLA's bytes beside the formula's")):
    p = sub.add_parser(name, help=text)
    common(p, config=True)
    if name in ("launch", "slurm"):
      p.add_argument("--script", default="train.py")
      p.add_argument("--coordinator", default="node0:1234")
    if name == "dry-run":
      p.add_argument("--layers", type=int, default=2)
  sub.add_parser("presets", help="model and device presets").add_argument("--json", action="store_true")
  sub.add_parser("topology", help="the devices present").add_argument("--json", action="store_true")
  size = sub.add_parser("size", help="NeMo's model size for a time budget (8·N·T rule)")
  size.add_argument("--days", type=float, required=True)
  size.add_argument("--tokens", type=float, required=True, help="training tokens, e.g. 300e9")
  size.add_argument("--gpus", type=int, required=True)
  size.add_argument("--tflops", type=float, required=True, help="achieved TFLOP/s per device")
  size.add_argument("--json", action="store_true")
  days = sub.add_parser("days", help="NeMo's training days (8·N·T rule)")
  days.add_argument("--model", required=True, help="preset, config.json path or size (7.5B)")
  days.add_argument("--tokens", type=float, required=True)
  days.add_argument("--gpus", type=int, required=True)
  days.add_argument("--tflops", type=float, required=True, help="achieved TFLOP/s per device")
  days.add_argument("--json", action="store_true")
  return parser


def _setup(args):
  model = parse_model(args.model, args.seq)
  cluster = Cluster(args.gpus, args.gpus_per_node, args.gpu)
  return model, cluster


def _config(args) -> ParallelConfig | None:
  given = {k: getattr(args, k) for k in ("dp", "tp", "pp", "cp", "ep") if getattr(args, k)}
  if not given:
    return None
  tp, pp, cp = given.get("tp", 1), given.get("pp", 1), given.get("cp", 1)
  dp = given.get("dp", max(1, args.gpus // (tp * pp * cp)))
  return ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=given.get("ep", 1), zero_stage=args.zero,
                        micro_batch_size=args.mbs, recompute=args.recompute,
                        virtual_stages=args.virtual_stages,
                        sequence_parallel=False if args.no_sequence_parallel else None)


def _evaluation(args) -> Evaluation:
  model, cluster = _setup(args)
  config = _config(args)
  kw = dict(global_batch_size=args.global_batch, seq_len=args.seq, precision=args.precision,
            optimizer=args.optimizer)
  if config is not None:
    return evaluate(model, cluster, config, **kw)
  advice = recommend(model, cluster, top_k=1, **kw)
  if advice.best is None:
    raise errors.InfeasiblePlanError(
        f"no configuration of {model.name} fits {cluster.num_devices}x {cluster.device}; "
        f"closest: {advice.rejected[0].config.label() if advice.rejected else 'none'}")
  return advice.best


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
  from rich.console import Console
  from rich.table import Table

  table = Table(title=title)
  for c in columns:
    table.add_column(c, justify="left" if c in ("config", "why", "name") else "right",
                     no_wrap=c != "why")
  for r in rows:
    table.add_row(*r)
  console = Console()
  if not console.is_terminal:  # piped: do not squeeze rows into 80 columns
    console = Console(width=220)
  console.print(table)


def _row(e: Evaluation) -> list[str]:
  return [e.config.label(), f"{e.memory['total'] / GIB:.1f}", f"{e.step_time_s:.2f}",
          f"{e.tokens_per_s:,.0f}", f"{e.tflops_per_device:.0f}", f"{100 * e.mfu:.1f}",
          f"{e.cost_per_million_tokens:.3f}"]


COLUMNS = ["config", "GiB/dev", "step s", "tokens/s", "TFLOP/s/dev", "MFU %", "$/Mtok"]


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    return _run(args)
  except errors.JaxdistError as e:
    print(f"jaxdist advise {args.command}: {e}", file=sys.stderr)
    return 2


def _run(args) -> int:
  cmd = args.command
  if cmd == "presets":
    models = {name: ModelSpec.from_preset(name).summary() for name in presets()}
    if args.json:
      print(json.dumps({"models": models, "devices": devices()}, indent=1, default=str))
      return 0
    _table("model presets", ["name", "params (B)", "layers", "hidden", "heads/kv", "experts"],
           [[n, f"{m['num_params'] / 1e9:.1f}", str(m["num_layers"]), str(m["hidden_size"]),
             f"{m['num_heads']}/{m['num_kv_heads']}",
             f"{m['num_experts']}x top{m['experts_per_token']}" if m["num_experts"] > 1 else "-"]
            for n, m in models.items()])
    _table("device presets", ["name", "GiB", "bf16 TFLOP/s", "HBM TB/s", "node GB/s", "net GB/s", "$/h"],
           [[n, f"{d['memory_bytes'] / GIB:.0f}", f"{d['peak_bf16_flops'] / 1e12:.0f}",
             f"{d['hbm_bandwidth'] / 1e12:.2f}", f"{d['intra_node_bandwidth'] / 1e9:.0f}",
             f"{d['inter_node_bandwidth'] / 1e9:.1f}", f"{d['price_per_hour']:.2f}"]
            for n, d in devices().items()])
    return 0
  if cmd == "topology":
    info = topology()
    if args.json:
      print(json.dumps(info, indent=1))
    else:
      for k, v in info.items():
        if k != "gpu_topology":
          print(f"{k}: {v}")
      if info["gpu_topology"]:
        print(info["gpu_topology"])
    return 0
  if cmd == "size":
    n = model_size(args.days, args.tokens, args.gpus, args.tflops)
    print(json.dumps({"num_params": n}) if args.json else
          f"{n / 1e9:.2f}B parameters train on {args.tokens:.3g} tokens in {args.days:g} days on "
          f"{args.gpus} devices at {args.tflops:g} TFLOP/s each (8·N·T rule)")
    return 0
  if cmd == "days":
    model = parse_model(args.model)
    d = training_days(model.num_params, args.tokens, args.gpus, args.tflops)
    print(json.dumps({"days": d, "num_params": model.num_params}) if args.json else
          f"{d:.1f} days for {model.num_params / 1e9:.1f}B parameters on {args.tokens:.3g} tokens, "
          f"{args.gpus} devices at {args.tflops:g} TFLOP/s each (8·N·T rule)")
    return 0
  if cmd in ("recommend", "pareto"):
    model, cluster = _setup(args)
    kw = dict(global_batch_size=args.global_batch, seq_len=args.seq, precision=args.precision,
              optimizer=args.optimizer)
    if cmd == "recommend":
      advice = recommend(model, cluster, top_k=args.top, objective=args.objective,
                         allow_cross_node_tp=args.allow_cross_node_tp, **kw)
      shown = advice.candidates
    else:
      advice = recommend(model, cluster, top_k=10 ** 6, objective="cost", **kw)
      shown = advice.pareto(args.against)
      if args.plot:
        _plot(shown, advice, args.plot)
    if args.csv:
      advice.to_csv(args.csv)
    if args.json:
      print(json.dumps([dict(e.to_dict(), why=advice.explain(e)) for e in shown], indent=1))
      return 0 if shown else 1
    title = (f"{model.name} ({model.num_params / 1e9:.1f}B) on {cluster.num_devices}x "
             f"{cluster.device}, batch {args.global_batch}: {advice.evaluated} valid configurations"
             + (", Pareto front" if cmd == "pareto" else ""))
    _table(title, COLUMNS + ["why"], [_row(e) + [advice.explain(e)] for e in shown])
    if not shown:
      print("nothing fits; the closest:")
      for e in advice.rejected[:3]:
        print(e.summary())
      return 1
    return 0
  e = _evaluation(args)
  if cmd == "memory":
    print(json.dumps(e.to_dict(), indent=1) if args.json else e.summary())
    return 0
  if cmd == "validate":
    problems = validate(e.model, e.cluster, e.config, global_batch_size=args.global_batch,
                        seq_len=args.seq)
    if args.json:
      print(json.dumps({"config": e.config.to_dict(), "problems": problems, "fits": e.fits}))
    else:
      print(e.config.label() + (": valid" if not problems else ""))
      for p in problems + ([] if e.fits else e.problems[-1:]):
        print(f"  - {p}")
    return 0 if not problems and e.fits else 1
  if cmd == "launch":
    out = {"config": e.config.label(), "code": launch.python_code(e),
           "hosts": launch.host_env(e, args.coordinator),
           "local_dry_run": launch.local_command(e, args.script)}
    if args.json:
      print(json.dumps(out, indent=1))
    else:
      print(f"# {e.config.label()}\n\n{out['code']}\n\n# hosts (environment of each process):")
      for i, env in enumerate(out["hosts"]):
        print(f"#   host {i}: " + " ".join(f"{k}={v}" for k, v in env.items()))
      print(f"\n# local dry run on simulated CPU devices:\n{out['local_dry_run']}")
    return 0
  if cmd == "slurm":
    print(launch.slurm_script(e, args.script))
    return 0
  if cmd == "dry-run":
    from jaxdist.advise.dry_run import dry_run

    result = dry_run(e, num_layers=args.layers)
    print(json.dumps(result, indent=1) if args.json else result["text"])
    return 0
  return 2


def _plot(front: list[Evaluation], advice, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  everything = advice.candidates
  fig, ax = plt.subplots(figsize=(7, 4.5))
  ax.scatter([e.cost_per_million_tokens for e in everything], [e.tokens_per_s for e in everything],
             s=8, alpha=0.3, label="fits")
  ax.plot([e.cost_per_million_tokens for e in front], [e.tokens_per_s for e in front], "o-",
          color="C3", label="Pareto front")
  for e in front:
    ax.annotate(f"{e.config.num_devices} dev", (e.cost_per_million_tokens, e.tokens_per_s),
                fontsize=7, xytext=(3, 3), textcoords="offset points")
  ax.set_xlabel("US$ per million tokens")
  ax.set_ylabel("tokens/s")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
