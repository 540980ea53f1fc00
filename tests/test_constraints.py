"""Rows no token satisfies, non-finite logits and failing stages, caught in the proposal
pipeline where they arise (without an engine); the rules forced grammar tokens pass."""

from __future__ import annotations

import pytest
import torch

from vllm import SamplingParams

from vllm_diffusion.worker.bad_words import UNDECIDED
from vllm_diffusion.worker.constraints import PositionRules, unsatisfiable_blocks
from vllm_diffusion.worker.proposal import ProposalPipeline, invalid_rows
from vllm_diffusion.worker.sampling import (ROW_FAILED, ROW_NO_TOKEN, ROW_NOT_FINITE,
                                            ROW_VALID)

MASK = 3
INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("row, code", [
    ([0.5, 1.0, -2.0, 0.0], ROW_VALID),
    ([-INF, 1.0, -INF, -INF], ROW_VALID),
    ([-INF] * 4, ROW_NO_TOKEN),
    ([0.0, NAN, 1.0, 2.0], ROW_NOT_FINITE),
    ([0.0, INF, 1.0, 2.0], ROW_NOT_FINITE),
    ([NAN, -INF, -INF, -INF], ROW_NOT_FINITE),
], ids=["finite", "one-left", "none-left", "nan", "overflow", "nan-only"])
def test_invalid_rows_tell_each_case(row, code):
    assert invalid_rows(torch.tensor([row])).tolist() == [code]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e-4])
def test_rows_without_a_token_are_flagged_not_drawn(temperature):
    """allowed_token_ids of only the mask token in one request, an overflowing bias in
    another, a plain third: the pipeline flags the first two requests' rows and draws the
    third exactly as alone (seeded)."""
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=temperature, seed=1, allowed_token_ids=[MASK]),
              SamplingParams(temperature=temperature, seed=1, logit_bias={5: 3e38, 6: 3e38}),
              SamplingParams(temperature=temperature, seed=1)]
    params[1].logit_bias[5] = 3e38  # the constructor clamps nothing; the sum overflows
    logits[2:4, 5] = 3e38
    pipeline = ProposalPipeline(MASK)
    proposals = pipeline.propose(logits.clone(), [2, 2, 2], params,
                                 [torch.Generator().manual_seed(1) for _ in range(3)])
    assert proposals.invalid.tolist() == [ROW_NO_TOKEN] * 2 + [ROW_NOT_FINITE] * 2 + [0] * 2
    alone = pipeline.propose(logits[4:].clone(), [2], params[2:],
                             [torch.Generator().manual_seed(1)])
    assert torch.equal(proposals.tokens[4:], alone.tokens)
    assert torch.equal(proposals.confidence[4:], alone.confidence)


def test_a_temperature_overflow_is_flagged():
    logits = torch.tensor([[1e37, 0.0, 1.0, 0.0]])
    # vLLM raises temperatures below 0.01 to 0.01; 1e37 / 0.01 overflows float32
    params = [SamplingParams(temperature=0.01, seed=0)]
    proposals = ProposalPipeline(MASK).propose(logits, [1], params, [None])
    assert proposals.invalid.tolist() == [ROW_NOT_FINITE]


def test_a_failing_stage_fails_its_request_alone():
    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(2))
    hidden = torch.eye(9)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=4,
                                                              max_tokens=13),
              SamplingParams(temperature=1.0, seed=5)]

    def compute_logits(rows):
        return rows @ logits

    def failing(batch):
        if any(p.max_tokens == 13 for p in batch.params):
            raise RuntimeError("stage failed")

    for max_rows in (None, 3):
        pipeline = ProposalPipeline(MASK, max_rows=max_rows)
        reference = pipeline.propose_from_hidden(
            compute_logits, hidden, [3, 3, 3], params,
            [None, torch.Generator().manual_seed(4), torch.Generator().manual_seed(5)])
        pipeline.logit_stages = [*pipeline.logit_stages, failing]
        errors: dict[int, Exception] = {}
        got = pipeline.propose_from_hidden(
            compute_logits, hidden, [3, 3, 3], params,
            [None, torch.Generator().manual_seed(4), torch.Generator().manual_seed(5)],
            errors=errors)
        assert list(errors) == [1] and "stage failed" in str(errors[1])
        assert got.invalid.tolist() == [0] * 3 + [ROW_FAILED] * 3 + [0] * 3
        keep = torch.tensor([True] * 3 + [False] * 3 + [True] * 3)
        assert torch.equal(got.tokens[keep], reference.tokens[keep])
        with pytest.raises(RuntimeError, match="stage failed"):
            pipeline.propose_from_hidden(compute_logits, hidden, [3, 3, 3], params,
                                         [None] * 3)


def test_only_the_leftmost_undecided_position_or_a_moving_block_fails_a_request():
    invalid = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 2, 0]], dtype=torch.int8)
    masked = torch.tensor([[False, True, True, True], [False, True, True, True],
                           [True, True, True, True]])
    computed = torch.ones_like(masked)
    # block 0: F = 1 flagged; block 1: only a decided position flagged; block 2: F valid
    assert unsatisfiable_blocks(invalid, masked, computed, rewrites=False) == [(0, 1, 1)]
    assert unsatisfiable_blocks(invalid, masked, computed, rewrites=True) == [
        (0, 1, 1), (1, 0, 1), (2, 2, 2)]
    computed[0, 1] = False  # not computed this step: nothing is known there
    assert unsatisfiable_blocks(invalid, masked, computed, rewrites=False) == []


def test_position_rules_check_allowed_ids_min_tokens_and_bad_words_with_walked_tokens():
    params = SamplingParams(allowed_token_ids=[10, 11, 12, 2], min_tokens=3)
    params._all_stop_token_ids = {2}
    params._bad_words_token_ids = [[10, 11]]
    # output so far: [12], then the block (output positions 1..4) undecided
    rules = PositionRules.of(params, first_output=1, context=[12] + [UNDECIDED] * 4,
                             block_size=4)
    assert not rules.admits(0, 7)  # not allowed
    assert not rules.admits(0, 2)  # output index 1 < min_tokens 3: stop barred
    assert rules.admits(2, 2)  # output index 3: stop allowed
    assert rules.admits(1, 11)  # no 10 before it
    rules.place(0, 10)
    assert not rules.admits(1, 11)  # the walk put 10 before it: "10 11" barred
