"""The KV cache of one sequence as one contiguous buffer (the feature draft's one layer; the lean
pass keeps its sessions in a paged pool, ``specdec.modeling.paged``): preallocated, grown
geometrically, cropped in O(1). Its size in bytes is what it holds allocated (``nbytes``), which
is what a replica's KV pool accounts for."""

from __future__ import annotations

import torch

# Growth: by a quarter of what it holds, at least GROWTH_MIN positions. Appends stay amortised
# O(1) (each position is copied ~4 times at most) while a session holds at most a quarter more
# than it uses -- doubling left half a pool reserved and unused, and the sessions that needed it
# failed mid-generation (issue 42, item 5; paged KV is the batching issue's full answer).
GROWTH_FACTOR = 1.25
GROWTH_MIN = 64


class LeanCache:
    """Keys and values of one sequence for every layer: [layers, kv_heads, capacity, head_dim]
    each, the first ``length`` positions valid. ``crop(-n)`` forgets the last n positions."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, max_length: int, capacity: int = 0
    ):
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.max_length = max_length
        self.length = 0
        self.keys = self._alloc(min(capacity, max_length))
        self.values = self._alloc(min(capacity, max_length))

    def _alloc(self, capacity: int) -> torch.Tensor:
        layers, heads, dim = self.shape
        # zeros, not empty: the invariant attention weighs positions past the length by 0, and 0 * NaN
        # (what uninitialised memory may hold) is not 0
        return torch.zeros(layers, heads, capacity, dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def planned_capacity(self, length: int, most: int | None = None) -> int:
        """The capacity :meth:`reserve` would give for ``length`` positions: unchanged if they fit,
        else grown geometrically (GROWTH_FACTOR, at least GROWTH_MIN more) but never past the
        context, nor past ``most`` where ``length`` fits within it (a cap on what this cache may
        hold)."""
        if length <= self.capacity:
            return self.capacity
        # a first allocation is exact (a prompt's size is known); growth after it is geometric
        grown = max(int(self.capacity * GROWTH_FACTOR), self.capacity + GROWTH_MIN) if self.capacity else length
        capacity = min(self.max_length, max(length, grown))
        if most is not None and most < capacity:
            capacity = max(length, most)  # the caps bound the growth; what is needed is asked as is
        return capacity

    def reserve(self, length: int, most: int | None = None) -> None:
        """Make room for ``length`` positions (see :meth:`planned_capacity`)."""
        if length <= self.capacity:
            return
        if length > self.max_length:
            raise ValueError(f"{length} positions exceed the model context of {self.max_length}")
        capacity = self.planned_capacity(length, most)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = self._alloc(capacity)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def crop(self, n: int) -> None:
        """transformers' convention: a negative ``n`` removes that many trailing positions."""
        if n >= 0:
            raise ValueError("LeanCache.crop takes a negative count of positions to remove")
        self.length = max(0, self.length + n)

    def nbytes(self) -> int:
        """Bytes held allocated (valid positions or not): what the session accounts for."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
