"""When the MPMD driver's stage programs ran: recorded spans, the bubble, a picture.

With ``exe.record_timeline = True`` (``exe`` a pipeline's executable), every step records
each forward and backward program: when the driver issued it, and when its results were
ready (one thread per device group waits on them in issue order, which is the order a
group runs them). A program started when it was issued, its group had finished the
program before it, and the program it reads from had finished, whichever came last.
The spans land in ``exe.stats["timeline"]``; the update programs are not recorded.
A backward program's gradient accumulator is donated to the stage's next backward, so
while recording the driver issues that one only once the one before it has been seen
done (it could not start earlier anyway; issuing the programs after it waits too).

On simulated CPU devices every group shares the host's cores, so spans stretch when
groups overlap; on accelerators each group has its own.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import jax

from jaxdist.pipeline.schedule import BACKWARD, FORWARD


@dataclasses.dataclass(frozen=True)
class Span:
  """One stage program of a step, in seconds from the step's start."""

  kind: str  # "F" or "B"
  stage: int
  micro_batch: int
  group: int  # the device group that ran it (the stage, or stage mod groups when interleaved)
  start: float
  end: float


class Recorder:
  """Collects one step's spans; ``issued`` after each program call, ``spans`` at the end."""

  def __init__(self, num_groups: int):
    self._origin = time.perf_counter()
    self._issued: list[tuple[str, int, int, int, float]] = []
    self._ready: dict[int, float] = {}
    self._seen = threading.Condition()
    self._queues = [queue.SimpleQueue() for _ in range(num_groups)]
    self._threads = [threading.Thread(target=self._wait, args=(q,), daemon=True)
                     for q in self._queues]
    for t in self._threads:
      t.start()

  def _wait(self, q):
    while (item := q.get()) is not None:
      index, results = item
      jax.block_until_ready(results)
      with self._seen:
        self._ready[index] = time.perf_counter()
        self._seen.notify_all()

  def issued(self, kind: str, stage: int, micro_batch: int, group: int, at: float,
             results) -> int:
    """Records a program issued at ``at`` whose ``results`` are waited on; returns its index."""
    self._queues[group].put((len(self._issued), results))
    self._issued.append((kind, stage, micro_batch, group, at))
    return len(self._issued) - 1

  def wait_for(self, index: int) -> None:
    """Blocks until program ``index``'s results were seen ready (before they are donated)."""
    with self._seen:
      self._seen.wait_for(lambda: index in self._ready)

  def spans(self, num_stages: int) -> list[Span]:
    for q in self._queues:
      q.put(None)
    for t in self._threads:
      t.join()
    done: dict[tuple[str, int, int], float] = {}
    group_free: dict[int, float] = {}
    out = []
    for index, (kind, s, b, g, at) in enumerate(self._issued):
      if kind == FORWARD:
        dep = done.get((FORWARD, s - 1, b), 0.0)
      else:
        dep = done.get((BACKWARD, s + 1, b) if s < num_stages - 1 else (FORWARD, s, b), 0.0)
      end = self._ready[index]
      start = min(max(at, group_free.get(g, 0.0), dep), end)
      done[kind, s, b] = group_free[g] = end
      out.append(Span(kind, s, b, g, start - self._origin, end - self._origin))
    return out


def bubble_fraction(spans: list[Span]) -> float:
  """Idle over total time of the device groups, from the first start to the last end
  (the schedule's ideal is ``(p − 1) / (m + p − 1)`` with equal passes)."""
  begin, finish = min(s.start for s in spans), max(s.end for s in spans)
  groups = {s.group for s in spans}
  busy = sum(s.end - s.start for s in spans)
  return 1.0 - busy / (len(groups) * (finish - begin))


def draw(spans: list[Span], path: str, title: str = "") -> None:
  """Saves a picture of ``spans``: device groups by time, forwards and backwards coloured,
  each block labelled with its micro-batch."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  groups = sorted({s.group for s in spans})
  begin = min(s.start for s in spans)
  fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(groups)))
  colours = {FORWARD: "#4c72b0", BACKWARD: "#dd8452"}
  for s in spans:
    x, w = (s.start - begin) * 1e3, (s.end - s.start) * 1e3
    ax.barh(s.group, w, left=x, height=0.8, color=colours[s.kind], edgecolor="white", lw=0.5)
    ax.text(x + w / 2, s.group, str(s.micro_batch), ha="center", va="center", fontsize=7,
            color="white")
  name = "stage" if all(s.stage == s.group for s in spans) else "device group"
  ax.set_yticks(groups, [f"{name} {g}" for g in groups])
  ax.invert_yaxis()
  ax.set_xlabel("ms from the first program's start")
  ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()],
            labels=["forward", "backward"], loc="upper left", bbox_to_anchor=(1.0, 1.0),
            fontsize=8)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
