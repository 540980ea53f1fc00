"""Ada-DLM's freezing decision: the batched engine path equals the per-block rule, and the
per-block rule equals the test's plain-loop reference, on a named grid of blocks."""

from __future__ import annotations

import pytest
import torch
from reference_early_skip import ada_freeze

from vllm_diffusion.policies.ada import (batched_freeze_positions,
                                                     capacity_count, freeze_positions)

# (block size, masked positions per block, history length, capacity, confidence floor,
#  static threshold)
GRID = {
    "b4-all-masked-h3": (4, [4, 3, 1, 0], 3, 0.15, 0.0, None),
    "b16-mixed-h3": (16, [16, 9, 2, 1], 3, 0.15, 0.0, None),
    "b16-mixed-h3-floor": (16, [16, 9, 2, 1], 3, 0.15, 0.6, None),
    "b16-mixed-h3-floor-static": (16, [16, 9, 2, 1], 3, 0.15, 0.8, 0.7),
    "b32-capacity-half": (32, [32, 20, 5, 3], 3, 0.5, 0.0, None),
    "b32-capacity-half-floor-high": (32, [32, 20, 5, 3], 3, 0.5, 0.95, None),
    "b32-static-high": (32, [32, 20, 5, 3], 3, 0.15, 0.0, 0.9),
    "b32-capacity-one": (32, [32, 7, 2, 1], 2, 1.0, 0.0, None),
    "b64-h1": (64, [64, 33, 17, 1], 1, 0.15, 0.0, None),
}


def random_blocks(block: int, counts: list[int], history: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    masked = torch.zeros(len(counts), block, dtype=torch.bool)
    for row, count in enumerate(counts):
        masked[row, torch.randperm(block, generator=generator)[:count]] = True
    confidence = torch.rand(len(counts), block, generator=generator)
    confidence[0, :2] = 0.5  # a tie
    trajectory = torch.rand(len(counts), block, history, generator=generator)
    trajectory[..., 0] = confidence
    return confidence, masked, trajectory


@pytest.mark.parametrize("name", GRID)
def test_batched_freeze_equals_the_per_block_rule_and_the_reference(name):
    block, counts, history, capacity, floor, static = GRID[name]
    for seed in range(5):
        confidence, masked, trajectory = random_blocks(block, counts, history, seed)
        rows = len(counts)
        batched = batched_freeze_positions(
            confidence, masked, trajectory,
            torch.full((rows,), capacity, dtype=torch.float64),
            torch.full((rows,), floor, dtype=torch.float64),
            torch.full((rows,), float("nan") if static is None else static,
                       dtype=torch.float64))
        for row in range(rows):
            single = freeze_positions(confidence[row], masked[row], trajectory[row], capacity,
                                      floor, static)
            assert torch.equal(batched[row], single)
            want = ada_freeze(confidence[row].tolist(), masked[row].tolist(),
                              trajectory[row].tolist(), capacity, floor, static)
            assert single.tolist() == want
            if counts[row]:
                assert bool(single.any()) and not bool((single & ~masked[row]).any())
            if static is not None:  # everything masked above the threshold freezes
                assert bool(single[masked[row] & (confidence[row] > static)].all())


def test_capacity_count_rounds_up_without_float_noise():
    assert capacity_count(0.15, 20) == 3  # 0.15 * 20 = 3.0000000000000004 in floats
    assert capacity_count(0.15, 21) == 4
    assert capacity_count(0.15, 1) == 1
    assert capacity_count(1.0, 7) == 7
