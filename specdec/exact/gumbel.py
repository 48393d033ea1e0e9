"""Invariant sampling: Gumbel-max with noise that is a pure function of (seed, position, token).

For every absolute position t and token v, g_t(v) is standard Gumbel noise computed from
(seed, t, v) alone, by any process, on any device, in any batch. Then

- target-only sampling is x_t = argmax_v [log p_t(v) + g_t(v)], which is distributed exactly as
  p_t (the Gumbel-max trick);
- a draft proposes y_t = argmax_v [log q_t(v) + g_t(v)] with the same noise;
- verification accepts y_t while y_t == x_t; at the first mismatch it emits x_t, and after k
  accepted proposals the bonus x_{t+k}.

Every emitted token is an x_t, and every accepted prefix is the target-only prefix, so the output
is the target-only output for the seed, token for token, whatever the draft, k, schedule, batch
or replica (docs/exactness.md, "Invariant sampling", checks the argument and the acceptance it
costs).

The generator: the key of (seed, t) is 32-bit words of BLAKE2b (as specdec.exact.rng keys its
draws); a token's 53-bit uniform takes 26 bits of h1 = fmix(v xor k0) and 27 of
fmix(h1 xor k1), murmur3's 32-bit finalizer -- integer operations in int64 tensors that never
overflow (products are split into 16-bit halves), so every device computes the same bits; the
uniform becomes Gumbel noise by -log(-log u) in float64.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

INVARIANT_PURPOSE = 5  # beside specdec.exact.rng.Purpose's 1-4: a distinct key space
_MASK32 = 0xFFFFFFFF
_TWO_POW_53 = float(1 << 53)


def position_keys(seed: int, position: int) -> tuple[int, int, int, int]:
    """Four 32-bit key words of (seed, position)."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    digest = hashlib.blake2b(
        struct.pack("<QQB", seed & 0xFFFFFFFFFFFFFFFF, position, INVARIANT_PURPOSE), digest_size=16
    ).digest()
    return struct.unpack("<IIII", digest)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for x in [0, 2^32), without leaving int64's range (in place)."""
    high = x * (constant >> 16)
    high.bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(constant & 0xFFFF).add_(high).bitwise_and_(_MASK32)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer (a bijection of [0, 2^32) with full avalanche), in place."""
    h.bitwise_xor_(h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h.bitwise_xor_(h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h.bitwise_xor_(h >> 16)


def uniforms(seed: int, positions: Sequence[int], vocab_size: int, device=None) -> torch.Tensor:
    """[len(positions), vocab_size] float64 uniforms in (0, 1), one per (position, token)."""
    keys = torch.tensor([position_keys(seed, t) for t in positions], dtype=torch.int64, device=device)
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=device).unsqueeze(0)
    first = _fmix32(tokens ^ keys[:, 0:1])  # a bijection of the token ids: distinct per row
    second = _fmix32(first ^ keys[:, 1:2])
    first.bitwise_right_shift_(6).bitwise_left_shift_(27).add_(second.bitwise_right_shift_(5))  # 26 + 27 bits
    return first.to(torch.float64).add_(0.5).div_(_TWO_POW_53)


def gumbel_noise(seed: int, positions: Sequence[int], vocab_size: int, device=None) -> torch.Tensor:
    """[len(positions), vocab_size] standard Gumbel noise g_t(v), float64."""
    return uniforms(seed, positions, vocab_size, device).log_().neg_().log_().neg_()


def gumbel_argmax(logprobs: torch.Tensor, noise: torch.Tensor) -> list[int]:
    """argmax_v [log p(v) + g(v)] of each row (a token with p = 0, log p = -inf, never wins)."""
    return torch.argmax(logprobs.to(torch.float64) + noise, dim=-1).tolist()


def invariant_decision(proposals: Sequence[int], target_tokens: Sequence[int]) -> tuple[int, list[int]]:
    """(accepted, emitted) for a block: ``target_tokens`` are the target's x for each proposal's
    position and the bonus position after them (len(proposals) + 1). Proposals are accepted
    while they equal x; the step emits x up to and including the first mismatch (or the bonus)."""
    if len(target_tokens) != len(proposals) + 1:
        raise ValueError(f"need {len(proposals) + 1} target tokens for {len(proposals)} proposals")
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted, list(target_tokens[: accepted + 1])
