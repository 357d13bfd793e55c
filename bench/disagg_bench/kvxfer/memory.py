"""KV-cache memory of one rank: DRAM (numpy) or GPU memory (torch CUDA tensor), one buffer.

All ``2 * num_layers`` regions lie back to back in one allocation, registered with NIXL as one
region (vLLM registers one region per layer tensor; the mapping in :mod:`layout` takes any list of
region bases, so that shape works too).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .layout import KVLayout, token_offsets


class KVMemory:
    def __init__(self, layout: KVLayout, device: str = "cpu") -> None:
        self.layout = layout
        self.device = device
        n = layout.total_bytes
        if device == "cpu":
            self._np = np.zeros(n, dtype=np.uint8)
            self._torch = None
            self.base = int(self._np.ctypes.data)
            self.mem_type = "DRAM"
            self.dev_id = 0
        elif device.startswith("cuda"):
            import torch

            self._torch = torch.zeros(n, dtype=torch.uint8, device=device)
            self._np = None
            self.base = int(self._torch.data_ptr())
            self.mem_type = "VRAM"
            self.dev_id = int(self._torch.device.index or 0)
        else:
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
        self.nbytes = n
        self.region_bases = layout.contiguous_region_bases(self.base)

    # --- NIXL registration -----------------------------------------------------------------
    def reg_descs(self) -> list[tuple[int, int, int, str]]:
        return [(self.base, self.nbytes, self.dev_id, "")]

    # --- whole-request access (tests, benchmark verification) ---------------------------------
    def _offsets(self, block_ids: Sequence[int], num_tokens: int) -> np.ndarray:
        return token_offsets(self.layout, block_ids, num_tokens, self.layout.contiguous_region_bases(0))

    def write_tokens(self, block_ids: Sequence[int], num_tokens: int, data: np.ndarray) -> None:
        """Scatter ``data`` of shape (regions, local heads, tokens, head_bytes) uint8 into blocks."""
        off = self._offsets(block_ids, num_tokens)
        idx = off[..., None] + np.arange(self.layout.head_bytes, dtype=np.int64)
        if self._np is not None:
            self._np[idx] = data
        else:
            import torch

            t_idx = torch.from_numpy(idx.reshape(-1)).to(self._torch.device)
            self._torch[t_idx] = torch.from_numpy(np.ascontiguousarray(data).reshape(-1)).to(self._torch.device)

    def read_tokens(self, block_ids: Sequence[int], num_tokens: int) -> np.ndarray:
        off = self._offsets(block_ids, num_tokens)
        idx = off[..., None] + np.arange(self.layout.head_bytes, dtype=np.int64)
        if self._np is not None:
            return self._np[idx]
        import torch

        t_idx = torch.from_numpy(idx.reshape(-1)).to(self._torch.device)
        return self._torch[t_idx].cpu().numpy().reshape(idx.shape)

    def fill_random_blocks(self, block_ids: Sequence[int], seed: int) -> None:
        """Fill whole blocks (every region) with seeded random bytes (benchmark), a region at a time."""
        lay = self.layout
        ids = list(block_ids)
        if self._np is not None:
            view = self._np.reshape(lay.num_regions, lay.num_blocks, lay.block_bytes)
            rng = np.random.default_rng(seed)
            for r in range(lay.num_regions):
                view[r, ids, :] = rng.integers(0, 256, size=(len(ids), lay.block_bytes), dtype=np.uint8)
            return
        import torch

        g = torch.Generator(device=self._torch.device).manual_seed(seed)
        view = self._torch.view(lay.num_regions, lay.num_blocks, lay.block_bytes)
        t_ids = torch.tensor(ids, device=self._torch.device)
        for r in range(lay.num_regions):
            view[r, t_ids, :] = torch.randint(0, 256, (len(ids), lay.block_bytes), dtype=torch.uint8, device=self._torch.device, generator=g)

    def checksum_blocks(self, block_ids: Sequence[int]) -> int:
        """Position-weighted checksum of whole blocks in order (same blocks, same bytes -> same sum)."""
        lay = self.layout
        ids = list(block_ids)
        total = 0
        if self._np is not None:
            view = self._np.reshape(lay.num_regions, lay.num_blocks, lay.block_bytes)
            w = (np.arange(len(ids) * lay.block_bytes, dtype=np.int64) % 65521 + 1).reshape(len(ids), lay.block_bytes)
            for r in range(lay.num_regions):
                total += int((view[r, ids, :].astype(np.int64) * w).sum()) * (r + 1)
            return total
        import torch

        view = self._torch.view(lay.num_regions, lay.num_blocks, lay.block_bytes)
        t_ids = torch.tensor(ids, device=self._torch.device)
        w = (torch.arange(len(ids) * lay.block_bytes, device=self._torch.device, dtype=torch.int64) % 65521 + 1).view(len(ids), lay.block_bytes)
        acc = torch.zeros((), dtype=torch.int64, device=self._torch.device)
        for r in range(lay.num_regions):
            acc += (view[r, t_ids, :].to(torch.int64) * w).sum() * (r + 1)
        return int(acc.item())

    def tensor(self) -> Any:
        return self._np if self._np is not None else self._torch


def pattern(layout: KVLayout, num_tokens: int, seed: int) -> np.ndarray:
    """Deterministic content of a request for this rank's heads: (regions, local heads, tokens, head_bytes).

    Value depends on (seed, region, *global* head, token, byte) so any TP slicing can be checked.
    """
    r = np.arange(layout.num_regions, dtype=np.int64)[:, None, None, None]
    h = (layout.head_start + np.arange(layout.heads_per_rank, dtype=np.int64))[None, :, None, None]
    t = np.arange(num_tokens, dtype=np.int64)[None, None, :, None]
    b = np.arange(layout.head_bytes, dtype=np.int64)[None, None, None, :]
    v = seed * 1000003 + r * 7919 + h * 104729 + t * 31 + b * 131
    return ((v ^ (v >> 7)) % 251).astype(np.uint8)
