"""LLaDA2.1's token editing: a filled position of the block whose proposal differs from
its token with probability above ``editing_threshold`` takes the proposal; the block ends
after a post step (one that begins with no mask) that edits nothing or after
``max_post_steps`` of them. Reference: ``tests/reference_unmasking.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def choose_edits(configs: Sequence[Any], confidence: torch.Tensor, proposals: torch.Tensor,
                 tokens: torch.Tensor, filled: torch.Tensor
                 ) -> tuple[torch.Tensor | None, list[int | None] | None]:
    """The step's edits: [R, B] bool, the filled positions that take their proposal, and
    per block the most post steps it may take (None: it does not edit); (None, None) where
    no block edits (``configs``: each block's options; confidence [R, B] float32,
    proposals and tokens [R, B] int64, filled [R, B] bool)."""
    limits = [c.editing_threshold for c in configs]
    if all(limit is None for limit in limits):  # the common step: one pass, nothing built
        return None, None
    limit = torch.tensor([float("inf") if x is None else x for x in limits])
    edits = filled & (proposals != tokens) & (confidence > limit[:, None])
    return edits, [None if c.editing_threshold is None else c.max_post_steps
                   for c in configs]


def block_ends(max_post_steps: int | None, edited: bool, began_unmasked: bool,
               post_steps_taken: int) -> bool:
    """Whether a block with no mask left after a step ends (``max_post_steps``: None where
    it does not edit; ``edited``: the step changed a filled token; ``began_unmasked``: the
    step began with no mask, a post step; ``post_steps_taken``: its post steps so far,
    this one included)."""
    if max_post_steps is None:
        return True
    if not began_unmasked:
        return max_post_steps == 0
    return not edited or post_steps_taken >= max_post_steps
