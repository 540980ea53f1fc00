"""Step state kept per request slot (``step.slots``): the slot allocator, the block buffer
that canvases are rows of (written in place), the policies' slot tables, and the runner
giving a request's slot back when it finishes or fails."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_diffusion.step.request import BlockCanvas, DiffusionRequest
from vllm_diffusion.step.slots import BlockSlots, SlotTable, block_tokens, slot_index

MASK = 9


def test_slots_are_handed_out_lowest_first_and_reused_after_release():
    slots = BlockSlots(4, 3)
    assert [slots.acquire() for _ in range(3)] == [0, 1, 2]
    slots.release(1)
    slots.release(0)
    assert slots.in_use == 1
    assert slots.acquire() == 0 and slots.acquire() == 1
    with pytest.raises(ValueError, match="slot 5 is not held"):
        slots.release(5)
    slots.release(2)
    with pytest.raises(ValueError, match="slot 2 is not held"):
        slots.release(2)  # given back twice


def test_slots_grow_when_all_are_held_and_keep_their_rows():
    slots = BlockSlots(4, 2)
    first = DiffusionRequest("a", None, None, False, block_slots=slots, slot=slots.acquire())
    canvas = first.block_for(0, [5, 6], 4, MASK)
    slots.acquire()
    assert slots.acquire() == 2 and slots.capacity == 4  # doubled
    assert slots.tokens.shape == (4, 4) and slots.decoded_at.shape == (4, 4)
    assert canvas.tokens.tolist() == [5, 6, MASK, MASK]  # read through the new tensors
    canvas.commit(torch.tensor([False, False, True, False]), torch.tensor([5, 6, 7, MASK]))
    assert slots.tokens[first.slot].tolist() == [5, 6, 7, MASK]


def test_a_canvas_is_its_slots_row_written_in_place():
    slots = BlockSlots(4, 2)
    other = slots.acquire()
    request = DiffusionRequest("r", None, None, False, block_slots=slots, slot=slots.acquire())
    canvas = request.block_for(8, [3], 4, MASK)
    assert canvas.slots is slots and canvas.slot == request.slot
    assert slots.tokens[request.slot].tolist() == [3, MASK, MASK, MASK]
    assert slots.decoded_at[request.slot].tolist() == [-1] * 4
    row = slots.tokens[request.slot]
    canvas.commit(torch.tensor([False, True, False, True]), torch.tensor([3, 4, MASK, 6]))
    canvas.commit(torch.tensor([False, False, True, False]), torch.tensor([3, 4, 5, 6]))
    assert row.tolist() == [3, 4, 5, 6]  # the same storage, written in place
    assert slots.decoded_at[request.slot].tolist() == [-1, 0, 1, 0]
    # LLaDA2.2's rewriting: position 1's token moves to 2, a new mask at 1
    canvas.rearrange(torch.tensor([0, -1, 1, 3]), torch.tensor([3, MASK, 4, 6]))
    assert slots.tokens[request.slot].tolist() == [3, MASK, 4, 6]
    assert slots.decoded_at[request.slot].tolist() == [-1, -1, 0, 0]
    assert canvas.masked(MASK).tolist() == [False, True, False, False]
    assert slots.tokens[other].tolist() == [0] * 4  # no other row touched
    # the next block is the same row, started anew; its steps continue the request's
    following = request.block_for(12, [], 4, MASK)
    assert following is not canvas and following.first_step == 2
    assert row.tolist() == [MASK] * 4 and slots.decoded_at[request.slot].tolist() == [-1] * 4


def test_a_canvas_made_apart_from_a_runner_has_a_row_of_its_own():
    tokens = torch.tensor([1, MASK, 2])
    canvas = BlockCanvas(0, tokens)
    canvas.tokens[1] = 7
    assert canvas.tokens.tolist() == [1, 7, 2] and tokens.tolist() == [1, MASK, 2]
    assert canvas.decoded_at.tolist() == [-1, -1, -1]


def test_a_steps_blocks_are_one_index_of_the_slots():
    slots = BlockSlots(2, 4)
    requests = []
    for name, fixed in (("a", [1]), ("b", [2, 3]), ("c", [])):
        request = DiffusionRequest(name, None, None, False, block_slots=slots,
                                   slot=slots.acquire())
        request.block_for(0, fixed, 2, MASK)
        requests.append(request)
    slots.release(requests[0].slot)
    requests = requests[:0:-1]  # c, b: any order of slots
    assert slot_index(requests).tolist() == [2, 1]
    assert block_tokens([r.canvas for r in requests]).tolist() == [[MASK, MASK], [2, 3]]
    apart = [BlockCanvas(0, torch.tensor([4, 5])), BlockCanvas(0, torch.tensor([6, MASK]))]
    assert block_tokens(apart).tolist() == [[4, 5], [6, MASK]]  # stacked


def test_a_slot_table_grows_to_the_slots_asked_for_and_resets_rows():
    table = SlotTable((2, 3), torch.float32, fill=0.0)
    assert table.data.shape == (0, 2, 3)
    table.covering(torch.tensor([1, 0]))[1] = 5.0
    assert table.data.shape == (2, 2, 3)
    table.covering(4)[4] = 1.0
    assert table.data.shape == (5, 2, 3) and bool((table.data[1] == 5.0).all())
    table.covering([5, 2])
    assert table.data.shape == (10, 2, 3)  # at least doubled
    table.reset([1, 4])
    assert not bool(table.data.any())


class _Runner:
    """The runner's request bookkeeping alone (no model): its diffusion requests and
    slots, as ``DiffusionRunnerMixin`` keeps them."""

    def __init__(self):
        from vllm_diffusion.worker.outputs import DiffusionStats

        self.block_slots = BlockSlots(4, 2)
        self.diffusion_requests = {}
        self.diffusion_stats = DiffusionStats()
        self.input_batch = types.SimpleNamespace(req_ids=[])

    def _update_states(self, scheduler_output):
        pass

    def add(self, req_id):
        request = DiffusionRequest(req_id, None, None, False, block_slots=self.block_slots,
                                   slot=self.block_slots.acquire())
        self.diffusion_requests[req_id] = request
        return request


def test_the_runner_gives_a_slot_back_when_its_request_finishes_or_fails():
    from vllm_diffusion.worker.runner import DiffusionRunnerMixin
    from vllm_diffusion.worker.failure_isolation import StepFailures

    runner = _Runner()
    runner._forget = DiffusionRunnerMixin._forget.__get__(runner)
    finished, failing, kept = (runner.add(r).slot for r in ("done", "failing", "kept"))
    assert (finished, failing, kept) == (0, 1, 2) and runner.block_slots.capacity == 4
    output = types.SimpleNamespace(finished_req_ids={"done", "never-started"},
                                   total_num_scheduled_tokens=0)
    DiffusionRunnerMixin.execute_model(runner, output)  # finished (or aborted)
    assert set(runner.diffusion_requests) == {"failing", "kept"}
    assert runner.block_slots.in_use == 2
    failures = StepFailures(runner.diffusion_stats, runner._forget)
    failures.fail("failing", "choosing its commits", RuntimeError("broken"))
    assert set(runner.diffusion_requests) == {"kept"} and runner.block_slots.in_use == 1
    assert runner.add("next").slot == finished  # the lowest slot given back
    assert runner.add("after").slot == failing
