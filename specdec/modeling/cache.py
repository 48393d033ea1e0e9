"""The KV cache of one sequence as the project's own passes keep it (the lean Llama pass, the
feature draft): preallocated, grown by doubling, cropped in O(1). Its size in bytes is what it
holds allocated (``nbytes``), which is what a replica's KV pool accounts for."""

from __future__ import annotations

import torch


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
        return torch.empty(layers, heads, capacity, dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def planned_capacity(self, length: int, most: int | None = None) -> int:
        """The capacity :meth:`reserve` would give for ``length`` positions: unchanged if they fit,
        else doubled (so appends are amortised O(1)) but never past the context, nor past ``most``
        where ``length`` fits within it (a cap on what this cache may hold)."""
        if length <= self.capacity:
            return self.capacity
        capacity = min(self.max_length, max(length, 2 * self.capacity))
        if most is not None and length <= most < capacity:
            capacity = most
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
