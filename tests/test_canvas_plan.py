"""Full attention without an engine: the canvas geometry, the rows a step plans for a
request (its whole sequence, logits for the current block's rows), and the refusals of
policies that cannot decode under full attention."""

from __future__ import annotations

import pytest
import torch

from vllm_diffusion.capabilities import ModelCapabilities, refusal
from vllm_diffusion.policies import POLICIES
from vllm_diffusion.policies.standard import StandardConfig, StandardPolicy
from vllm_diffusion.step.request import DiffusionRequest
from vllm_diffusion.worker.canvas_plan import (PAST_CANVAS_TOKEN, CanvasPlanner,
                                               plan_canvas_request, row_planner)
from vllm_diffusion.worker.geometry import CanvasGeometry, step_geometry
from vllm_diffusion.worker.step_plan import KnownTokens, gather_step

MASK = 99
FULL = ModelCapabilities(family="LLaDA", attention="full")


def new_request(policy):
    config = StandardConfig()
    return DiffusionRequest("r", config, policy.new_state(config), False)


@pytest.mark.parametrize("block", [1, 4, 32])
def test_canvas_geometry_blocks_start_at_the_prompt_end(block):
    g = CanvasGeometry(block, canvas_tokens=8 * block, max_model_len=4096)
    for prompt in (1, 5, 37):
        for emitted in range(0, 3 * block + 2):
            start = g.block_start(prompt, prompt + emitted)
            assert start == prompt + emitted // block * block
            assert (start - prompt) % block == 0 and start <= prompt + emitted < start + block


def test_canvas_end_is_max_tokens_and_slides():
    g = CanvasGeometry(4, canvas_tokens=8, max_model_len=4096)
    # the whole output fits in the canvas: it ends at max_tokens
    assert g.step_end(10, 10, 6) == 16
    assert g.step_end(10, 15, 6) == 16
    # a longer output: the canvas reaches 8 past the current block's start
    assert g.step_end(10, 10, 40) == 18
    assert g.step_end(10, 17, 40) == 14 + 8
    assert g.step_end(10, 47, 40) == 50  # the last block
    # never past the model length
    assert CanvasGeometry(4, 64, max_model_len=16).step_end(10, 10, 6) == 16


def test_step_geometry_by_regime():
    assert isinstance(step_geometry("full", 4, 8, 64), CanvasGeometry)
    assert not isinstance(step_geometry("block_causal", 4, 8, 64), CanvasGeometry)


def test_plan_rows_are_the_whole_sequence_logits_for_the_block():
    policy = StandardPolicy(4, MASK, StandardConfig())
    geometry = CanvasGeometry(4, canvas_tokens=8, max_model_len=64)
    request = new_request(policy)
    prompt = [5, 6, 7]
    rows = plan_canvas_request("r", KnownTokens(prompt, []), 0, 3, geometry, MASK, request,
                               policy, False, max_tokens=10)
    # canvas: max_tokens 10, but at most 8 past the block start (3)
    assert rows.positions == list(range(11))
    assert rows.token_ids == prompt + [MASK] * 8
    assert rows.kv_len == 11 and rows.committed == 0
    assert rows.block_row_start == 3 and rows.block_positions.tolist() == [0, 1, 2, 3]
    step = gather_step([rows, rows], torch.device("cpu"))
    assert step.requests[0].block_rows.tolist() == [3, 4, 5, 6]
    assert step.requests[1].block_rows.tolist() == [14, 15, 16, 17]

    # two tokens of the block decided (one emitted), the next step keeps the canvas
    request.canvas.tokens[:] = torch.tensor([20, MASK, 22, MASK])
    rows = plan_canvas_request("r", KnownTokens(prompt, [20]), 0, 11, geometry, MASK,
                               request, policy, False, max_tokens=10)
    assert rows.token_ids == prompt + [20, MASK, 22, MASK] + [MASK] * 4
    # the block done and emitted: the next block starts at 7, the canvas ends at 13
    rows = plan_canvas_request("r", KnownTokens(prompt, [20, 21, 22, 23]), 0, 11, geometry,
                               MASK, request, policy, False, max_tokens=10)
    assert request.canvas.start == 7
    assert rows.positions == list(range(13))
    assert rows.token_ids == prompt + [20, 21, 22, 23] + [MASK] * 6
    # its last block: two positions of the canvas, two decided past its end
    rows = plan_canvas_request("r", KnownTokens(prompt, list(range(20, 28))), 0, 13,
                               geometry, MASK, request, policy, False, max_tokens=10)
    assert rows.positions == list(range(13)) and rows.block_positions.tolist() == [0, 1]
    assert request.canvas.tokens.tolist() == [MASK, MASK, PAST_CANVAS_TOKEN,
                                              PAST_CANVAS_TOKEN]


def test_shifted_logits_come_from_the_rows_one_before_the_block():
    """Dream's position j is predicted by row j - 1: the block's logits are read from the
    row of the last known token on; the rows themselves are the same."""
    policy = StandardPolicy(8, MASK, StandardConfig())
    geometry = CanvasGeometry(8, canvas_tokens=8, max_model_len=64)
    prompt = [5, 6, 7]
    plain, shifted = (plan_canvas_request("r", KnownTokens(prompt, []), 0, 3, geometry, MASK,
                                          new_request(policy), policy, False, max_tokens=6,
                                          logits_shift=shift) for shift in (0, 1))
    assert shifted.positions == plain.positions == list(range(9))
    assert shifted.token_ids == plain.token_ids == prompt + [MASK] * 6
    assert (plain.block_row_start, shifted.block_row_start) == (3, 2)
    assert shifted.block_positions.tolist() == list(range(6))
    step = gather_step([plain, shifted], torch.device("cpu"))
    assert step.requests[0].block_rows.tolist() == [3, 4, 5, 6, 7, 8]
    assert step.requests[1].block_rows.tolist() == [11, 12, 13, 14, 15, 16]
    # the planner takes the shift from the model's declaration
    dream = ModelCapabilities(family="Dream", attention="full", shifted_logits=True)
    assert row_planner(geometry, MASK, dream).logits_shift == 1
    assert row_planner(geometry, MASK, FULL).logits_shift == 0


def test_positions_past_the_model_length_are_decided_and_not_computed():
    policy = StandardPolicy(4, MASK, StandardConfig())
    geometry = CanvasGeometry(4, canvas_tokens=8, max_model_len=9)
    request = new_request(policy)
    rows = plan_canvas_request("r", KnownTokens([1, 2, 3], [40, 41, 42, 43]), 0, 9, geometry,
                               MASK, request, policy, False, max_tokens=6)
    assert rows.positions == list(range(9))
    assert rows.block_positions.tolist() == [0, 1]
    assert request.canvas.tokens.tolist() == [MASK, MASK, PAST_CANVAS_TOKEN,
                                              PAST_CANVAS_TOKEN]


def test_a_partly_scheduled_request_computes_nothing():
    policy = StandardPolicy(4, MASK, StandardConfig())
    planner = CanvasPlanner(CanvasGeometry(4, 8, 64), MASK)
    rows = planner.plan("r", KnownTokens([1, 2, 3, 4, 5], []), 0, 3, new_request(policy),
                        policy, False, max_tokens=8)
    assert rows.positions == [] and rows.request is None and rows.committed == 0


def test_full_attention_refuses_what_cannot_decode_under_it():
    assert refusal(FULL, POLICIES["standard"], {}) is None
    why = refusal(FULL, POLICIES["standard"], {"chunk_size": 2})
    assert "whole sequence" in why
    for name in ("focus", "elastic"):
        why = refusal(FULL, POLICIES[name], {})
        assert why is not None and "'full'" in why, name
    # the seed methods decode under full attention: ES-dLLM and Sparse-dLLM in the dual
    # cache only (test_capabilities), Ada-DLM under any cache mode
    for name in ("es", "sparse_prefix"):
        assert "'diffusion_cache_mode' 'recompute'" in refusal(FULL, POLICIES[name], {})
    assert refusal(FULL, POLICIES["ada"], {}) is None


def test_shifted_logits_under_a_cache_plan_the_dream_block_loop():
    """Fast-dLLM's Dream block loop under ``dual``: the refresh computes the whole
    sequence and offers only the block's first position (read from the row before the
    block, committed whatever the rule); a later step computes the block alone and reads
    positions 1.. from rows 0..; while the first position is still a mask (its commit
    undone), the next step refreshes again instead of leaving it unreadable."""
    policy = StandardPolicy(4, MASK, StandardConfig())
    geometry = CanvasGeometry(4, canvas_tokens=8, max_model_len=64, cache_mode="dual")
    request = new_request(policy)
    prompt = KnownTokens([5, 6, 7], [])

    def plan():
        return plan_canvas_request("r", prompt, 0, 3, geometry, MASK, request, policy,
                                   False, max_tokens=8, logits_shift=1)

    rows = plan()
    assert rows.positions == list(range(11)) and rows.kv_refresh
    assert rows.block_positions.tolist() == [0] and rows.block_row_start == 2
    assert rows.commit_candidates
    request.canvas.tokens[0] = 30  # the refresh committed the first position
    rows = plan()
    assert rows.positions == [3, 4, 5, 6] and not rows.kv_refresh
    assert rows.block_positions.tolist() == [1, 2, 3] and rows.block_row_start == 0
    assert not rows.commit_candidates
    request.canvas.tokens[0] = MASK  # undone (a bad word, a grammar): refresh again
    rows = plan()
    assert rows.positions == list(range(11)) and rows.kv_refresh and rows.commit_candidates
    assert rows.block_positions.tolist() == [0]
