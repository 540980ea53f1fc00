"""Block-causal steps of a model whose logits are shifted
(``ModelCapabilities.shifted_logits``: row t predicts token t + 1, an autoregressive head
kept by a block-diffusion model).

The rows are ``step_plan.plan_request``'s; what moves is the row each block position's
logits are read from, always the row before it:

- a block whose first position is known (a prompt token, or one an earlier step
  decided) is computed whole, as every step computes it, and position j is read from
  row j - 1 (positions 1..B-1 from rows 0..B-2; the known first position needs none);
- a block whose first position is still masked (the known tokens end on the block's
  start) is first given that token by the previous block's last row: the step computes
  the commit rows of the blocks before it (their exact KV, every row seeing its whole
  block) and none of the new block's, and reads position 0 from the last of them. This is
  a clean block's commit fused with one autoregressive step; the block's denoising steps
  follow, with its first token known. Should the step hold no commit row (that row's KV
  cached already), the row is computed again, which rewrites its KV unchanged. That
  step's proposal is the argmax at any temperature, as the published commit step's;
- a step that computes a run of the block's positions from a known one (the active
  sub-block under Fast-dLLM v2's block cache, ``policies/sub_block_cache.py``) reads each
  later position of the run from the row before it, all rows of the run.
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
    """``rows`` (a block step planned whole) with each block position's logits read from
    the row before it."""
    if rows.request is None:  # a prefill chunk: no logits
        return rows
    if len(rows.block_positions) != block_size:
        return shift_run_rows(rows, mask_token_id)
    num_commit = len(rows.positions) - block_size
    if int(rows.canvas.tokens[0]) != mask_token_id:
        return dataclasses.replace(rows, block_positions=after_first(block_size),
                                   block_row_start=num_commit)
    start = rows.canvas.start
    if start == 0:
        raise RuntimeError(f"request {rows.req_id}: a block at position 0 with no known "
                           f"token has no row to read its first token from")
    positions, tokens = rows.positions[:num_commit], rows.token_ids[:num_commit]
    if not positions:
        positions, tokens = [start - 1], token_ids[start - 1:start]
    return dataclasses.replace(rows, positions=positions, token_ids=tokens, kv_len=start,
                               block_positions=first_only(),
                               block_row_start=len(positions) - 1, argmax_proposals=True)


def shift_run_rows(rows: RequestRows, mask_token_id: int) -> RequestRows:
    """``rows`` (a step planned on a run of block positions that starts at a known one)
    with each later position of the run read from the row before it."""
    computed = rows.block_positions  # [n] int64, ascending
    start, count = int(computed[0]), len(computed)
    if (int(computed[-1]) != start + count - 1
            or int(rows.canvas.tokens[start]) == mask_token_id):
        raise RuntimeError(f"request {rows.req_id}: the policy planned part of a block of a "
                           f"model whose logits are shifted other than a run of positions "
                           f"from a known one (its traits should have refused it)")
    return dataclasses.replace(rows, block_positions=computed[1:],
                               block_row_start=len(rows.positions) - count)


@functools.lru_cache(maxsize=8)
def after_first(block_size: int) -> torch.Tensor:
    """[B - 1] int64: 1..B-1 (shared, never written)."""
    return torch.arange(1, block_size)


@functools.lru_cache(maxsize=1)
def first_only() -> torch.Tensor:
    """[1] int64: the block's first position (shared, never written)."""
    return torch.zeros(1, dtype=torch.long)


class ShiftedBlockPlanner(BlockPlanner):
    """Plans block-causal steps (``plan_request``) with shifted logits
    (``shift_block_rows``)."""

    def plan(self, req_id: str, token_ids: KnownTokens, num_computed: int, num_scheduled: int,
             request: DiffusionRequest, policy: DecodingPolicy, resumed: bool,
             max_tokens: int) -> RequestRows:
        rows = super().plan(req_id, token_ids, num_computed, num_scheduled, request, policy,
                            resumed, max_tokens)
        return shift_block_rows(rows, token_ids, self.geometry.block_size,
                                self.mask_token_id)
