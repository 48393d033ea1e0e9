"""Counter-based randomness: every random number is a pure function of its key.

A draw is keyed by (request seed, absolute position in the sequence, purpose). Nothing is carried
from one draw to the next, so the same seed gives the same output whatever the timing, the
replica that served a step, or how many other sessions were interleaved with it. Each key is
consumed by at most one decision that reaches the output, which is what the exactness proof needs
(see docs/exactness.md).

The generator is BLAKE2b of the packed key, truncated to 53 bits: a keyed hash is the simplest
counter-based generator with no statistical structure to worry about, and it costs about a
microsecond.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from enum import IntEnum

_TWO_POW_53 = float(1 << 53)


class Purpose(IntEnum):
    DRAFT = 1  # the draft's sample of proposal y_i
    ACCEPT = 2  # the coordinator's acceptance uniform u_i
    RECOVERED = 3  # the target's residual draw r_i
    BONUS = 4  # the target's bonus draw after a fully accepted block


def uniform(seed: int, position: int, purpose: Purpose) -> float:
    """A uniform float in [0, 1) determined by (seed, position, purpose) alone."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    digest = hashlib.blake2b(
        struct.pack("<QQB", seed & 0xFFFFFFFFFFFFFFFF, position, int(purpose)), digest_size=8
    ).digest()
    return (int.from_bytes(digest, "little") >> 11) / _TWO_POW_53


def new_seed() -> int:
    """A fresh seed for a request that did not bring one (reported back to the client).

    63 bits so it survives every signed/unsigned 64-bit field on the way.
    """
    return secrets.randbits(63)
