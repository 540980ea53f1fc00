"""Block-causal steps of a model whose logits are shifted
(``ModelCapabilities.shifted_logits``: row t predicts token t + 1): the rows are
``step_plan.plan_request``'s, and each block position's logits are read from the row before
it. See docs/architecture.md, "Shifted logits, block-causal".
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from vllm_diffusion.policies.base import DecodingPolicy
from vllm_diffusion.step.request import DiffusionRequest
from vllm_diffusion.worker.step_plan import BlockPlanner, KnownTokens, RequestRows


def shift_block_rows(rows: RequestRows, token_ids: KnownTokens, block_size: int,
                     mask_token_id: int) -> RequestRows:
    """``rows`` (a block step, its block rows the request's last) with each block
    position's logits read from the row before it."""
    if rows.request is None:  # a prefill chunk: no logits
        return rows
    num_commit = len(rows.positions) - len(rows.block_positions)
    if int(rows.canvas.tokens[0]) != mask_token_id:
        if len(rows.block_positions) != block_size:
            return shift_partial_rows(rows, mask_token_id)
        return dataclasses.replace(rows, block_positions=after_first(block_size),
                                   block_row_start=num_commit, logits_shift=1)
    # the block's first token first, whatever part of the block the policy planned
    start = rows.canvas.start
    if start == 0:
        raise RuntimeError(f"request {rows.req_id}: a block at position 0 with no known "
                           f"token has no row to read its first token from")
    positions, tokens = rows.positions[:num_commit], rows.token_ids[:num_commit]
    if not positions:
        positions, tokens = [start - 1], token_ids[start - 1:start]
    return dataclasses.replace(rows, positions=positions, token_ids=tokens, kv_len=start,
                               block_positions=first_only(),
                               block_row_start=len(positions) - 1, argmax_proposals=True,
                               logits_shift=1)


def shift_partial_rows(rows: RequestRows, mask_token_id: int) -> RequestRows:
    """``rows`` (a step planned on part of a block) with the position after each computed
    row but the last read from that row."""
    computed = rows.block_positions  # [n] int64, ascending: the computed rows' positions
    count = len(computed)
    masked = rows.canvas.tokens[computed] == mask_token_id  # [n]
    read = torch.zeros(count, dtype=torch.bool)  # positions whose row before is computed
    read[1:] = computed[1:] == computed[:-1] + 1
    if bool((masked & ~read).any()):
        raise RuntimeError(f"request {rows.req_id}: the policy planned masked block "
                           f"positions {computed[masked & ~read].tolist()} of a model whose "
                           f"logits are shifted without the rows before them (its traits "
                           f"should have refused it)")
    return dataclasses.replace(rows, block_positions=computed[:-1] + 1,
                               block_row_start=len(rows.positions) - count, logits_shift=1)


@functools.lru_cache(maxsize=8)
def after_first(block_size: int) -> torch.Tensor:
    """[B - 1] int64: 1..B-1 (shared, never written)."""
    return torch.arange(1, block_size)


@functools.lru_cache(maxsize=1)
def first_only() -> torch.Tensor:
    """[1] int64: the block's first position (shared, never written)."""
    return torch.zeros(1, dtype=torch.long)


class ShiftedBlockPlanner(BlockPlanner):
    """Plans block-causal steps with shifted logits (``shift_block_rows``)."""

    def plan(self, req_id: str, token_ids: KnownTokens, num_computed: int, num_scheduled: int,
             request: DiffusionRequest, policy: DecodingPolicy, resumed: bool,
             max_tokens: int) -> RequestRows:
        rows = super().plan(req_id, token_ids, num_computed, num_scheduled, request, policy,
                            resumed, max_tokens)
        return shift_block_rows(rows, token_ids, self.geometry.block_size,
                                self.mask_token_id)
