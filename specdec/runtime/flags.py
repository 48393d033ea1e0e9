"""Argument types for command-line flags with a bound: a bad value is a usage error naming it."""

from __future__ import annotations

import argparse
import os

from specdec.engine.memory import parse_bytes, parse_kv_bytes


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def cpu_set(text: str) -> set[int]:
    """A list of CPU numbers as Linux writes them: 0, 0-3, 0,2,4-5."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last or first)
            if low < 0 or high < low:
                raise ValueError
            cpus.update(range(low, high + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be CPU numbers like 0, 0-3 or 0,2, got {text!r}") from None
    return cpus


def check_cpus_available(cpus: set[int], flag: str) -> None:
    """Refuse (SystemExit naming ``flag``) CPUs this process may not run on."""
    available = os.sched_getaffinity(0)
    if not cpus <= available:
        raise SystemExit(f"{flag} {sorted(cpus)}: this process may run on CPUs {sorted(available)} only")


def cpu_list(text: str) -> str:
    """:func:`cpu_set`'s text, checked (for a flag passed on to another process's --cpus)."""
    cpu_set(text)
    return text.strip()


def byte_count(text: str) -> int:
    """A byte count with an optional unit (256MiB, 2G); 0 allowed."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_byte_count(text: str) -> int | str:
    """``auto`` or a byte count."""
    try:
        return parse_kv_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
