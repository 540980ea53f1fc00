"""The commit choice of the threshold and quota strategies on the host, for small steps.

``batched_commits.batched_choose_commits`` decides R blocks with tensor operations, a
dozen or more of them whatever R; at batch 1 and block 4 each costs more than the
decision itself. Where every block follows one of ``HOST_STRATEGIES`` and the step has at
most ``MAX_HOST_POSITIONS`` positions, ``host_choose_commits`` decides them in Python over
the step's few values instead (the same rules, tested equal to the tensor path on its
named grid, ties and last steps included). Comparisons are those of float32 values, as
in the tensor path: thresholds are rounded to float32 first (``as_float32``).
"""

from __future__ import annotations

import struct

from vllm_diffusion.policies.unmasking import step_quota

HOST_STRATEGIES = frozenset({"low_confidence_dynamic", "low_confidence_static",
                             "sequential", "threshold"})
MAX_HOST_POSITIONS = 256  # R * B; beyond it the tensor path is cheaper


def as_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (as ``torch.tensor(value)`` holds it)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def host_choose_commits(confidence: list[list[float]], masked: list[list[bool]],
                        steps_taken: list[int], steps_allowed: list[int],
                        strategies: list[str], thresholds: list[float]
                        ) -> list[list[bool]]:
    """``batched_choose_commits`` for blocks that each follow one of ``HOST_STRATEGIES``:
    confidence and masked [R][B] (the candidates); per block its steps taken, its
    ``steps_for``, strategy name and float32 threshold. Returns [R][B] commits."""
    return [_block_commits(row, mask, taken, allowed, strategy, threshold)
            for row, mask, taken, allowed, strategy, threshold
            in zip(confidence, masked, steps_taken, steps_allowed, strategies, thresholds)]


def _block_commits(confidence: list[float], masked: list[bool], steps_taken: int,
                   steps_allowed: int, strategy: str, threshold: float) -> list[bool]:
    block = len(masked)
    candidates = [j for j in range(block) if masked[j]]
    if not candidates:
        return [False] * block
    if strategy == "threshold":
        if steps_taken >= steps_allowed - 1:  # the block's last step takes every mask
            return list(masked)
        best = max(candidates, key=lambda j: (confidence[j], -j))  # the first of ties
        return [masked[j] and (confidence[j] >= threshold or j == best)
                for j in range(block)]
    count = min(step_quota(block, steps_allowed, steps_taken), len(candidates))
    if strategy == "sequential":
        chosen = set(candidates[:count])
    else:
        above = [j for j in candidates if confidence[j] > threshold]
        if strategy == "low_confidence_dynamic" and len(above) >= count:
            chosen = set(above)
        else:  # the quota's most confident, ties to the lower position
            chosen = set(sorted(candidates, key=lambda j: (-confidence[j], j))[:count])
    return [j in chosen for j in range(block)]
