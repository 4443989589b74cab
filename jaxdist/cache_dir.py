"""Where jaxdist keeps files between processes: ``$JAXDIST_CACHE_DIR``, default
``~/.cache/jaxdist`` (plans under ``plans/``, calibration profiles under ``profiles/``)."""

from __future__ import annotations

import os
from pathlib import Path


def root() -> Path:
  return Path(os.environ.get("JAXDIST_CACHE_DIR")
              or os.path.join(os.path.expanduser("~"), ".cache", "jaxdist"))
