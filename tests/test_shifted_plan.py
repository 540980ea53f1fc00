"""Where a block position's logits are read when the model's logits are shifted
(``worker/shifted_plan.py``): from the row before it -- inside the block once its first
token is known, else from the last committed row, computed again where it is cached; a
run of positions from a known one (the active sub-block) from the rows of the run."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from vllm_diffusion.worker.step_plan import KnownTokens, RequestRows, gather_step
from vllm_diffusion.worker.shifted_plan import shift_block_rows

B, MASK = 4, 99


def rows_for(block_tokens: list[int], start: int, commit: list[int],
             known: KnownTokens) -> RequestRows:
    """What ``plan_request`` plans for a whole-block step: the commit rows, then the
    block's rows."""
    canvas = SimpleNamespace(tokens=torch.tensor(block_tokens), start=start)
    request = SimpleNamespace(canvas=canvas)
    positions = commit + list(range(start, start + B))
    tokens = known[commit[0]:start] if commit else []
    return RequestRows("r", positions, tokens + block_tokens, start + B, start, request,
                       torch.arange(B))


def read_rows(rows: RequestRows) -> list[int]:
    """The positions of the rows each computed block position's logits come from."""
    step = gather_step([rows], torch.device("cpu"))
    return [rows.positions[i] for i in step.requests[0].block_rows.tolist()]


def test_a_block_with_a_known_first_token_reads_each_position_from_the_row_before():
    known = KnownTokens([1, 2, 3, 4, 5, 6], [])  # the prompt ends inside block [4, 8)
    rows = shift_block_rows(rows_for([5, 6, MASK, MASK], 4, [0, 1, 2, 3], known), known, B,
                            MASK)
    assert rows.positions == [0, 1, 2, 3, 4, 5, 6, 7]
    assert rows.block_positions.tolist() == [1, 2, 3]
    assert read_rows(rows) == [4, 5, 6]


def test_a_new_block_takes_its_first_token_from_the_commit_rows_last():
    known = KnownTokens([1, 2, 3, 4], [7, 8, 9, 10])  # the output ends on a boundary
    planned = rows_for([MASK] * B, 8, [4, 5, 6, 7], known)
    rows = shift_block_rows(planned, known, B, MASK)
    assert rows.positions == [4, 5, 6, 7] and rows.token_ids == [7, 8, 9, 10]
    assert rows.kv_len == 8 and rows.block_positions.tolist() == [0]
    assert read_rows(rows) == [7]


def test_a_cached_last_row_is_computed_again():
    known = KnownTokens([1, 2, 3, 4, 5, 6, 7, 8], [])
    rows = shift_block_rows(rows_for([MASK] * B, 8, [], known), known, B, MASK)
    assert rows.positions == [7] and rows.token_ids == [8]
    assert read_rows(rows) == [7]


def test_a_run_from_a_known_position_reads_its_later_positions_from_the_rows_before():
    """The active sub-block alone (the block cache): block [4, 8) in sub-blocks of 2, the
    second computed from its known first position (rows 6 and 7); position 3 reads row 6."""
    known = KnownTokens([1, 2, 3, 4, 5, 6, 7], [])
    planned = dataclasses.replace(rows_for([5, 6, 7, MASK], 4, [], known), positions=[6, 7],
                                  token_ids=[7, MASK], block_positions=torch.tensor([2, 3]))
    rows = shift_block_rows(planned, known, B, MASK)
    assert rows.positions == [6, 7] and rows.block_positions.tolist() == [3]
    assert read_rows(rows) == [6]


def test_rows_with_gaps_read_the_position_after_each_row_but_the_last():
    """Rows with a gap (FOCUS's intra-block cache): block [4, 8) holding 5, a mask, 7, a
    mask; rows 4, 6 and 7 computed: positions 5 and 7 read rows 4 and 6, the last row reads
    nothing of the block. Without row 4, the masked position 5 is refused."""
    known = KnownTokens([1, 2, 3, 4, 5], [])
    gaps = dataclasses.replace(rows_for([5, MASK, 7, MASK], 4, [], known), positions=[4, 6, 7], token_ids=[5, 7, MASK],
                               block_positions=torch.tensor([0, 2, 3]))
    rows = shift_block_rows(gaps, known, B, MASK)
    assert rows.block_positions.tolist() == [1, 3] and read_rows(rows) == [4, 6]
    with pytest.raises(RuntimeError, match=r"masked block positions \[1\] .* without the "
                                           r"rows before them"):
        shift_block_rows(dataclasses.replace(gaps, positions=[5, 6, 7],
                                             token_ids=[MASK, 7, MASK],
                                             block_positions=torch.tensor([1, 2, 3])),
                         known, B, MASK)


@pytest.mark.parametrize("computed", [[2, 3], [0, 2]], ids=["masked-start", "gap"])
def test_a_masked_position_without_its_row_before_is_refused(computed):
    known = KnownTokens([1, 2], [])
    planned = rows_for([1, 2, MASK, MASK], 0, [], known)
    planned.block_positions = torch.tensor(computed)
    with pytest.raises(RuntimeError, match=r"planned masked block positions \[2\] of a model "
                                           r"whose logits are shifted without the rows"):
        shift_block_rows(planned, known, B, MASK)
