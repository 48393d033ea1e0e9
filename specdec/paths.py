"""Where specdec's files live: the source tree's shipped data and the per-user cache.

A foundation module like ``specdec.errors``: it imports nothing of the project, so every layer
may use it.
"""

from __future__ import annotations

import os
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the checkout: benchmarks/, models/, proto/
# prompt sets and results; an installed package (the image) points here with SPECDEC_BENCHMARKS_DIR
BENCHMARKS_DIR = Path(os.environ.get("SPECDEC_BENCHMARKS_DIR") or SOURCE_ROOT / "benchmarks")
CACHE_DIR_ENV = "SPECDEC_CACHE_DIR"


def cache_dir() -> Path:
    """Where converted models and compiled kernels are kept: ``$SPECDEC_CACHE_DIR``, else
    ``~/.cache/specdec``."""
    base = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    return Path(base)


class UntrustedPathError(RuntimeError):
    """A cache path another user could have written: nothing in it is loaded."""


def _check_owned(path: Path, what: str) -> None:
    info = path.lstat()
    if path.is_symlink():
        raise UntrustedPathError(f"{what} {path} is a symbolic link")
    if info.st_uid != os.getuid():
        raise UntrustedPathError(f"{what} {path} belongs to uid {info.st_uid}, not this user ({os.getuid()})")
    if info.st_mode & 0o022:
        raise UntrustedPathError(f"{what} {path} is writable by others (mode {info.st_mode & 0o777:o})")


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can write: made with mode 0700 if missing, else
    checked (owner, no group/other write, not a link); UntrustedPathError if it fails the check.
    For what is executed or loaded from a cache (a compiled kernel): a file planted there by
    another user must never run."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_owned(path, "cache directory")
    return path


def check_private_file(path: Path) -> None:
    """A file in a private_dir that may be loaded: owned by this user and not writable by others."""
    _check_owned(path, "cache file")
