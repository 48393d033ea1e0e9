"""The services' log set-up, in one place: each line names its process, and the level comes from
``SPECDEC_LOG_LEVEL`` for specdec's own loggers (INFO by default; DEBUG adds, among others, a line
per scored speculation regime window, docs/goodput.md). The launcher's services and the
coordinator's Ray actor inherit it from the environment they start in."""

from __future__ import annotations

import logging
import os

LEVEL_ENV = "SPECDEC_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def level_from(value: str | None) -> int | None:
    """The level a ``SPECDEC_LOG_LEVEL`` value names (case and spaces ignored; unset or empty:
    INFO), or None if it names none."""
    name = (value or "").strip().upper() or "INFO"
    return getattr(logging, name) if name in LEVELS else None


def configure(process: str) -> None:
    """The level applies to specdec's own loggers; the libraries' stay at INFO or above (at DEBUG,
    gRPC alone logs a line per call)."""
    value = os.environ.get(LEVEL_ENV)
    named = level_from(value)
    level = logging.INFO if named is None else named
    logging.basicConfig(level=max(level, logging.INFO), format=f"[specdec {process}] %(levelname)s %(message)s")
    logging.getLogger("specdec").setLevel(level)
    if named is None:  # a typo must not stop a service, nor pass unseen
        logging.getLogger("specdec").warning(
            "%s=%r is not a log level (one of %s): logging at INFO", LEVEL_ENV, value, ", ".join(LEVELS)
        )
