"""Preallocated key/value cache for one request: committed prefix plus a pending block.

A forward pass writes the keys and values of its n input tokens into the pending block
[length, length + n). `keep(indices)` then commits the chosen pending entries (the accepted
tree path, in order) to [length, length + len(indices)); everything else in the block is
garbage that the next forward overwrites. Knows nothing about trees or models.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, kv_heads, capacity, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [layers, kv_heads, capacity, head_dim]
        self.capacity = capacity
        self.length = 0  # committed tokens

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the pending block of `layer` and return its keys/values up to the block's end.

        k, v: [kv_heads, n, head_dim]. Returns two views [kv_heads, length + n, head_dim].
        """
        end = self.length + k.shape[1]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} > capacity {self.capacity}")
        self.k[layer, :, self.length:end] = k
        self.v[layer, :, self.length:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def keep(self, indices: torch.Tensor, contiguous: bool | None = None) -> None:
        """Commit the pending entries `indices` ([a], increasing positions within the block) in order.

        `contiguous`: whether they are 0..a-1 (nothing to move), when the caller knows; else it is read
        from the device (a host synchronisation)."""
        a = indices.numel()
        if contiguous is None:
            contiguous = bool(a == 0 or (indices[-1].item() == a - 1))
        if not contiguous:
            src = indices + self.length
            dst = slice(self.length, self.length + a)
            self.k[:, :, dst] = self.k[:, :, src]
            self.v[:, :, dst] = self.v[:, :, src]
        self.length += a

    def commit(self, count: int) -> None:
        """Commit the first `count` pending entries as they lie (`keep` of 0..count-1, without reading indices)."""
        self.length += count

    def reset(self) -> None:
        self.length = 0
