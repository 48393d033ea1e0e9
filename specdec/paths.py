"""Where specdec's files live: the source tree's shipped data and the per-user cache.

A foundation module like ``specdec.errors``: it imports nothing of the project, so every layer
may use it.
"""

from __future__ import annotations

import os
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the checkout: benchmarks/, models/, proto/
BENCHMARKS_DIR = SOURCE_ROOT / "benchmarks"
CACHE_DIR_ENV = "SPECDEC_CACHE_DIR"


def cache_dir() -> Path:
    """Where converted models and compiled kernels are kept: ``$SPECDEC_CACHE_DIR``, else
    ``~/.cache/specdec``."""
    base = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    return Path(base)
