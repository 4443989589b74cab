"""A progress bar for long work (planning mesh shapes, tuning trials), shown in a terminal.

The bar draws on stderr only when stderr is a terminal and ``JAXDIST_PROGRESS`` is not
"0"; elsewhere (CI, notebooks' captured output, pipes) it does nothing, and the same
events still go to ``logging``. rich is imported only when a bar is drawn.
"""

from __future__ import annotations

import contextlib
import os
import sys


def enabled() -> bool:
  return os.environ.get("JAXDIST_PROGRESS", "1") != "0" and sys.stderr.isatty()


class _Bar:
  """One task of a rich progress display: ``advance`` and ``describe`` it."""

  def __init__(self, progress, task):
    self._progress, self._task = progress, task

  def describe(self, text: str) -> None:
    if self._progress is not None:
      self._progress.update(self._task, description=text)

  def advance(self) -> None:
    if self._progress is not None:
      self._progress.advance(self._task)


@contextlib.contextmanager
def bar(total: int, description: str, show: bool = True):
  """Yields a ``_Bar`` of ``total`` steps; draws nothing unless ``show`` and ``enabled()``."""
  if not (show and enabled() and total > 1):
    yield _Bar(None, None)
    return
  from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                             TimeElapsedColumn)
  with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), transient=True,
                console=_console()) as progress:
    yield _Bar(progress, progress.add_task(description, total=total))


def _console():
  from rich.console import Console
  return Console(file=sys.stderr)
