"""A named grid of randomised FOCUS selection inputs (ties in delta, frozen and
never-processed positions, budgets from 0 to the block size, both context rules), shared by
the selection kernels' tests."""

from __future__ import annotations

import torch

# name: (requests, block size, distinct delta values (ties when small), seed)
GRID = {
    "b4": (16, 4, 1000, 1),
    "b16-ties": (24, 16, 3, 2),
    "b32": (24, 32, 1000, 3),
    "b64-ties": (16, 64, 5, 4),
    "b20-not-power-of-two": (12, 20, 1000, 5),
}


def make_case(requests, block, levels, seed, device):
    gen = torch.Generator().manual_seed(seed)
    delta = torch.randint(0, levels, (requests, block), generator=gen).float() / levels
    processing = torch.rand(requests, block, generator=gen) < 0.8
    processing[0] = True  # a first step of a block
    candidates = processing & (torch.rand(requests, block, generator=gen) < 0.7)
    candidates[1] = False  # nothing masked
    ever = torch.rand(requests, block, generator=gen) < 0.5
    budgets = torch.randint(0, block + 1, (requests,), generator=gen)
    selected_left = torch.rand(requests, generator=gen) < 0.5  # the two context rules
    return [t.to(device) for t in (delta, candidates, budgets, processing, ever, selected_left)]
