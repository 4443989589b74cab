"""PNG plots of suite rows (matplotlib, imported here only)."""

from __future__ import annotations

from pathlib import Path


def plot(rows, out: str | Path) -> list[Path]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out = Path(out)
  ok = [r for r in rows if r.status == "ok"]
  full = max((r.num_devices for r in ok), default=0)
  main = [r for r in ok if r.num_devices == full]
  paths = []
  models = list(dict.fromkeys(r.model for r in main))
  for metric, label, name in (
      (lambda r: r.projected_h100_s * 1e3, "projected step time on one H100 node (ms)", "step_time"),
      (lambda r: r.projected_mfu * 100, "projected MFU on one H100 node (%)", "tflops"),
      (lambda r: r.bytes_per_device / 2**20, "compiled bytes per device (MiB)", "memory")):
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
      mine = [r for r in main if r.model == model]
      ax.barh([r.method for r in mine], [metric(r) for r in mine],
              color=["C0" if r.kind == "hand" else "C3" for r in mine])
      ax.set_title(f"{model} ({full} devices)")
      ax.set_xlabel(label)
      ax.invert_yaxis()
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  scaling = [r for r in ok if r.suite == "gpt" and r.method in ("DataParallel", "ShardParallel (ILP)")]
  if len({r.num_devices for r in scaling}) > 1:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for method in ("DataParallel", "ShardParallel (ILP)"):
      pts = sorted((r.num_devices, r.projected_h100_s * 1e3) for r in scaling if r.method == method)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("projected step time (ms)")
    ax.set_title(f"{scaling[0].model}: scaling (fixed batch)")
    ax.legend()
    fig.tight_layout()
    path = out / "scaling.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths
