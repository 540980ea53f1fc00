"""What one denoising step computes for a full-attention request (``CanvasGeometry``): the
whole sequence to the canvas's end, nothing committed, logits for the block's rows only
(one row earlier where shifted). See docs/architecture.md, "Full attention".
"""

from __future__ import annotations

import torch

from vllm_diffusion.capabilities import ModelCapabilities
from vllm_diffusion.policies.base import DecodingPolicy
from vllm_diffusion.step.request import DiffusionRequest
from vllm_diffusion.worker.geometry import BlockGeometry, CanvasGeometry
from vllm_diffusion.worker.shifted_plan import ShiftedBlockPlanner
from vllm_diffusion.worker.step_plan import BlockPlanner, KnownTokens, RequestRows, whole_block

# The token at a block's positions past the canvas's end: decided from the block's start,
# never computed, never output (the request ends at max_tokens before them).
PAST_CANVAS_TOKEN = 0


def plan_canvas_request(req_id: str, token_ids: KnownTokens, num_computed: int,
                        num_scheduled: int, geometry: CanvasGeometry, mask_token_id: int,
                        request: DiffusionRequest, policy: DecodingPolicy, resumed: bool,
                        max_tokens: int, logits_shift: int = 0) -> RequestRows:
    """Rows of one full-attention request for this step; moves it to its current block.
    ``logits_shift``: how many rows before its position a position's logits are (1 where
    the model's logits are shifted, else 0)."""
    num_prompt, num_tokens = len(token_ids.prompt), len(token_ids)
    if num_computed + num_scheduled < num_tokens:
        return RequestRows(req_id, [], [], 0, 0, None)
    block_size = geometry.block_size
    block_start = geometry.block_start(num_prompt, num_tokens)
    end = geometry.step_end(num_prompt, num_tokens, max_tokens)
    block_end = min(block_start + block_size, end)
    previous = request.canvas
    canvas = request.block_for(block_start, token_ids[block_start:], block_size,
                               mask_token_id)
    if canvas is not previous:
        canvas.tokens[block_end - block_start:] = PAST_CANVAS_TOKEN
    refresh = canvas is not previous or resumed
    cached = geometry.cache_mode != "recompute"
    if cached and logits_shift and int(canvas.tokens[0]) == mask_token_id:
        # The block's first position is read from the row before the block, which only a
        # refresh computes: refresh again where the last one's commit was undone (a bad
        # word, a grammar) or its row was not usable.
        refresh = True
    plan = policy.plan_step(request, (("resumed" if canvas is previous else "new")
                                      if refresh else None))
    if plan.compute is not None or plan.key_end is not None:
        raise RuntimeError(f"the {policy.name} policy planned part of a block of a "
                           f"full-attention model (its traits should have refused it)")
    computed = block_end - block_start
    rows = geometry.computed_rows(block_start, block_end, end, refresh)
    tokens = (token_ids[rows.start:block_start] + canvas.tokens[:computed].tolist()
              + [mask_token_id] * (rows.stop - block_end))
    positions = (whole_block(block_size) if computed == block_size
                 else torch.arange(computed))
    first_alone = False
    if cached and logits_shift:  # Fast-dLLM's Dream block loop (docs/architecture.md)
        first_alone = refresh and int(canvas.tokens[0]) == mask_token_id
        positions = positions[:1] if first_alone else positions[1:]
    return RequestRows(req_id, list(rows), tokens, end, 0, request, positions,
                       block_row_start=(block_start + int(positions[0]) - rows.start
                                        - logits_shift) if len(positions) else None,
                       kv_refresh=refresh and cached, commit_candidates=first_alone,
                       logits_shift=logits_shift)


class CanvasPlanner:
    """Plans full-attention steps (``plan_canvas_request``) for the runner."""

    def __init__(self, geometry: CanvasGeometry, mask_token_id: int,
                 logits_shift: int = 0) -> None:
        self.geometry, self.mask_token_id, self.logits_shift = geometry, mask_token_id, logits_shift

    def plan(self, req_id: str, token_ids: KnownTokens, num_computed: int, num_scheduled: int,
             request: DiffusionRequest, policy: DecodingPolicy, resumed: bool,
             max_tokens: int) -> RequestRows:
        return plan_canvas_request(req_id, token_ids, num_computed, num_scheduled,
                                   self.geometry, mask_token_id=self.mask_token_id,
                                   request=request, policy=policy, resumed=resumed,
                                   max_tokens=max_tokens, logits_shift=self.logits_shift)


def row_planner(geometry: BlockGeometry | CanvasGeometry, mask_token_id: int,
                model: ModelCapabilities) -> BlockPlanner | CanvasPlanner:
    """The planner of the served model's geometry (``model``: its capabilities)."""
    if isinstance(geometry, CanvasGeometry):
        return CanvasPlanner(geometry, mask_token_id, int(model.shifted_logits))
    if model.shifted_logits:
        return ShiftedBlockPlanner(geometry, mask_token_id)
    return BlockPlanner(geometry, mask_token_id)
