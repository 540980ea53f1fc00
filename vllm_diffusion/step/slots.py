"""Step state that persists per request slot, updated in place and read without restacking:
a live request holds one slot from its first step to its end (kept across preemption), and
row s of every slot-indexed tensor is the request in slot s: ``BlockSlots`` (the runner's
current blocks, [S, B] host tensors), ``SlotTable`` (a policy's state, [S, ...]). A step's
[R, B] view is one index by its blocks' slots ([R] int64), not a stack.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import torch


class BlockSlots:
    """The slot allocator and the current block of every slot. Slots are handed out lowest
    first; when none is free the tensors double (rows kept): read rows through
    ``tokens[slot]`` when needed, not views kept across steps (growing replaces them)."""

    def __init__(self, block_size: int, capacity: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"a BlockSlots needs at least one slot, got {capacity}")
        self.block_size = block_size
        # [S, B] int64: the blocks' tokens (mask_token_id where undecided)
        self.tokens = torch.zeros(capacity, block_size, dtype=torch.long)
        # [S, B] int64: the request's denoising step that last changed each position (-1
        # where fixed or still masked)
        self.decoded_at = torch.full((capacity, block_size), -1, dtype=torch.long)
        self._free = list(range(capacity))  # a heap: the lowest free slot first
        self._used: set[int] = set()

    @property
    def capacity(self) -> int:
        return len(self.tokens)

    @property
    def in_use(self) -> int:
        return len(self._used)

    def acquire(self) -> int:
        """A free slot (the lowest), growing the tensors when every slot is held."""
        if not self._free:
            self._grow(2 * self.capacity)
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """Give ``slot`` back; its rows are rewritten by its next holder's first block."""
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not held")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        self.tokens = _grown(self.tokens, capacity, 0)
        self.decoded_at = _grown(self.decoded_at, capacity, -1)
        for slot in range(old, capacity):
            heapq.heappush(self._free, slot)


class SlotTable:
    """A policy's per-slot state: ``data`` [S, *row_shape], row s the request in slot s.
    Made empty; ``covering`` grows it (at least doubling; new rows ``fill``). A row keeps
    what its last holder left: the policy resets it when a request's block starts."""

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0,
                 device: torch.device | str = "cpu") -> None:
        self.fill = fill
        self.data = torch.full((0, *row_shape), fill, dtype=dtype, device=device)

    def covering(self, slots: int | torch.Tensor | Sequence[int]) -> torch.Tensor:
        """``data``, grown to hold row ``slots`` (a slot, or the largest of several)."""
        if isinstance(slots, torch.Tensor):
            largest = int(slots.max()) if slots.numel() else -1
        elif isinstance(slots, int):
            largest = slots
        else:
            largest = max(slots, default=-1)
        if largest >= len(self.data):
            self.data = _grown(self.data, max(largest + 1, 2 * len(self.data)), self.fill)
        return self.data

    def reset(self, slots: int | Sequence[int]) -> None:
        """Rows ``slots`` back to ``fill``."""
        if isinstance(slots, int):
            self.covering(slots)[slots] = self.fill
        elif slots:
            index = torch.tensor(list(slots), dtype=torch.long)
            self.covering(index).index_fill_(0, index.to(self.data.device), self.fill)


def _grown(tensor: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    grown = torch.full((rows, *tensor.shape[1:]), fill, dtype=tensor.dtype,
                       device=tensor.device)
    grown[:len(tensor)] = tensor
    return grown


def slot_index(requests: Sequence[Any]) -> torch.Tensor:
    """[R] int64: the slots of ``requests`` (``DiffusionRequest``s), in order."""
    return torch.tensor([r.slot for r in requests], dtype=torch.long)


def block_tokens(canvases: Sequence[Any]) -> torch.Tensor:
    """[R, B] int64: the tokens of these blocks (``BlockCanvas``es), one index of their
    ``BlockSlots`` (stacked where each has slots of its own, apart from a runner)."""
    slots = canvases[0].slots
    if all(c.slots is slots for c in canvases):
        return slots.tokens[torch.tensor([c.slot for c in canvases], dtype=torch.long)]
    return torch.stack([c.tokens for c in canvases])
