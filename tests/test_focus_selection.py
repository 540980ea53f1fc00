"""FOCUS budget, retained-set constraints and the neighbour-aware intra-block cache, on
hand-built inputs."""

from __future__ import annotations

import pytest
import torch
from selection_cases import GRID

from vllm_diffusion.kernels.selection import select_retained, token_budget
from vllm_diffusion.policies.parts.block_cache import IntraBlockCache

T, F = True, False


def bools(*values):
    return torch.tensor(values, dtype=torch.bool)


def test_budget_is_the_larger_of_history_and_outliers_capped_at_the_block():
    one_outlier = torch.tensor([0.0, 0.0, 0.0, 0.0, 10.0])  # mean 2, std 4: only 10 >= 6
    assert token_budget(one_outlier, mean_decoded=1.0, alpha=1.5, block_size=8) == 2
    assert token_budget(one_outlier, mean_decoded=3.0, alpha=1.5, block_size=8) == 5
    assert token_budget(one_outlier, mean_decoded=3.0, alpha=1.5, block_size=4) == 4
    two_groups = torch.tensor([0.0] * 6 + [5.0] * 4)  # mean 2, std 2.45: the four 5s count
    assert token_budget(two_groups, mean_decoded=1.0, alpha=1.5, block_size=16) == 4


def test_top_k_keeps_left_neighbours():
    delta = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.3, 0.0])
    everything = torch.ones(6, dtype=torch.bool)
    retained = select_retained(delta, everything, 2, everything, everything)
    assert retained.tolist() == [T, T, T, T, F, F]


def test_selected_left_context_adds_only_masked_left_neighbours_of_selected():
    # Positions 0-2 decoded and recomputed, 3-7 masked; top-2 by delta: 5 and 7.
    delta = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.2, 0.9, 0.3, 0.8])
    processing = torch.ones(8, dtype=torch.bool)
    candidates = bools(F, F, F, T, T, T, T, T)
    paper = select_retained(delta, candidates, 2, processing, processing, "retained_left")
    serving = select_retained(delta, candidates, 2, processing, processing, "selected_left")
    # Paper: 0-2 kept (recomputed) and every retained position's left neighbour: 4 (left of
    # 5) and 6 (left of 7). Serving code: the same here, as 4 and 6 are masked candidates.
    assert paper.tolist() == [T, T, T, F, T, T, T, T]
    assert serving.tolist() == [T, T, T, F, T, T, T, T]
    # With the decoded positions frozen (not processed), the left neighbour of a retained
    # decoded position differs: only the paper's rule pulls in masked 3 left of decoded 4.
    candidates = bools(F, F, F, T, F, T, T, T)
    processing = bools(F, F, F, T, T, T, T, T)
    delta = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.9, 0.3, 0.8])
    paper = select_retained(delta, candidates, 1, processing, processing, "retained_left")
    serving = select_retained(delta, candidates, 1, processing, processing, "selected_left")
    assert paper.tolist() == [F, F, F, T, T, T, F, F]  # 5, its left 4, and 4's left 3
    assert serving.tolist() == [F, F, F, F, T, T, F, F]  # 5 and the recomputed 4 only


def test_decode_rate_variants():
    from vllm_diffusion.policies.focus.policy import FocusConfig, FocusRequestState

    for rate, want in (("across_blocks", (2, 6, 3.0)), ("per_block", (0, 0, 1.0))):
        config = FocusConfig(decode_rate=rate)
        state = FocusRequestState(4)
        state.start_block(False, config)
        state.after_step(torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool), 4,
                         config)
        state.after_step(torch.zeros(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool), 2,
                         config)
        state.start_block(False, config)  # the next block
        assert (state.decoded_steps, state.decoded_tokens, state.mean_decoded) == want
    config = FocusConfig(decode_rate="per_block")
    state = FocusRequestState(4)
    state.start_block(False, config)
    state.after_step(torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool), 0,
                     config)  # decoded nothing: not counted
    state.after_step(torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool), 3,
                     config)
    assert (state.decoded_steps, state.decoded_tokens) == (1, 3)


def test_never_processed_masks_left_of_the_rightmost_retained_are_kept():
    delta = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.9, 0.5])
    candidates = torch.ones(6, dtype=torch.bool)
    ever_processed = bools(F, F, T, T, T, T)
    retained = select_retained(delta, candidates, 1, candidates, ever_processed)
    # top-1 is 4, its left neighbour 3, and the unprocessed masks 0 and 1 left of 4.
    assert retained.tolist() == [T, T, F, T, T, F]


def test_decoded_positions_needing_recomputation_are_kept_and_frozen_ones_are_not():
    delta = torch.tensor([0.0, 0.0, 0.9, 0.0, 0.0, 0.7])
    candidates = bools(F, F, T, T, T, T)
    processing = bools(F, T, T, T, T, T)  # 0 is frozen, 1 decoded but not yet
    retained = select_retained(delta, candidates, 1, processing, torch.ones(6, dtype=torch.bool))
    # 2 (top-1), 1 (recompute; also 2's left neighbour); 0 is frozen so never retained.
    assert retained.tolist() == [F, T, T, F, F, F]


def test_retained_set_is_never_empty():
    processing = bools(T, T, T, T)
    retained = select_retained(torch.zeros(4), bools(F, F, F, F), 0, processing, processing)
    assert retained.tolist() == [T, T, T, T]
    retained = select_retained(torch.zeros(4), processing, 0, processing, processing)
    assert retained.tolist() == [T, T, T, T]


def test_intra_block_cache_freezes_a_token_once_it_and_its_right_neighbour_are_decoded():
    cache = IntraBlockCache(block_size=4)
    assert cache.processing_set().tolist() == [T, T, T, T]  # first step: everything
    cache.update(masked_before_step=bools(T, T, T, T))  # step 0 decodes position 0
    assert cache.processing_set().tolist() == [T, T, T, T]  # 0 recomputed with its token
    cache.update(masked_before_step=bools(F, T, T, T))  # step 1 decodes position 1
    assert cache.processing_set().tolist() == [T, T, T, T]  # 0 waits for its neighbour
    cache.update(masked_before_step=bools(F, F, T, T))  # step 2 decodes position 3
    assert cache.processing_set().tolist() == [F, T, T, T]  # 0 frozen; 1's neighbour masked
    cache.update(masked_before_step=bools(F, F, T, F))  # step 3 decodes position 2
    # 3 is the last position (no right neighbour): frozen after one recomputation.
    assert cache.processing_set().tolist() == [F, T, T, F]
    cache.update(masked_before_step=bools(F, F, F, F))
    assert cache.processing_set().tolist() == [T, T, T, T]  # all frozen: recompute all


@pytest.mark.parametrize("name", GRID)
def test_vectorised_selection_equals_the_reference(name):
    """The torch path (no per-request loop) against the per-request reference."""
    from selection_cases import make_case

    from vllm_diffusion.kernels.selection import (batched_select_retained,
                                                  vectorised_select_retained)

    args = make_case(*GRID[name], device="cpu")
    assert torch.equal(vectorised_select_retained(*args), batched_select_retained(*args))


@pytest.mark.parametrize("name", GRID)
def test_batched_budget_equals_the_per_block_budget(name):
    """K per block as ``token_budget`` gives it (the block size where it would keep every
    candidate or there is none), NaN deltas included."""
    from selection_cases import make_case

    from vllm_diffusion.kernels.selection import batched_token_budget, wanted_by_rate

    delta, candidates, _, _, _, _ = make_case(*GRID[name], device="cpu")
    delta[2, 0] = float("nan")
    block = delta.shape[1]
    rates = [(0.5 + i % 4) * (i % 3) for i in range(len(delta))]
    by_rate = torch.tensor([wanted_by_rate(r, block) for r in rates])
    got = batched_token_budget(delta, candidates, by_rate, block)
    for row, (d, c) in enumerate(zip(delta, candidates)):
        count = int(c.sum())
        want = token_budget(d[c], rates[row], 1.0, block) if count else block
        assert int(got[row]) == (want if want < count else block), row
