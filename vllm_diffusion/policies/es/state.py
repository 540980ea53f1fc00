"""ES-dLLM's decision state (the ``es`` policy, ``policy.py``): per request where its block
stands (``EsState``); per slot each position's last confidence, the positions the previous
step decoded and the skip layers' cached outputs (``EsSlotState``)."""

from __future__ import annotations

import dataclasses

import torch

from vllm_diffusion.step.plans import StepBlocks
from vllm_diffusion.step.slots import SlotTable, slot_index


@dataclasses.dataclass
class EsState:
    """Per request: where its block stands. Its per-position state is its slot's rows of
    the policy's ``EsSlotState``."""

    full_step: bool = True  # this step computes every position through every layer
    kv_lost: bool = True  # no step has computed the block since its KV was (re)allocated
    started: bool = False  # a block started: the slot's rows hold its decision state
    # The slot's cached outputs still hold an earlier block's (or request's): zeroed
    # by the next forward's hooks, before any is read
    stale_outputs: bool = True
    # where logits are shifted: the step reads the block's first token from the previous
    # block's commit (none of the block's rows computed), and how many steps of the block
    # did (they are not the block's denoising steps)
    reads_first_token: bool = False
    first_token_steps: int = 0


class EsSlotState:
    """The decision state of every request, one row per slot (``step.slots``)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # [S, B] float32 (host): each position's confidence at the last step it reached
        # the logits
        self.confidence = SlotTable((block_size,), torch.float32)
        # [S, B] bool (host): the positions the previous step decoded
        self.decoded_last_step = SlotTable((block_size,), torch.bool)
        # layer -> [S, B, hidden] float32 (model device): each position's last output of
        # the layer; made at the first forward that reaches the layer
        self.outputs: dict[int, SlotTable] = {}

    def start_block(self, slot: int) -> None:
        self.confidence.reset(slot)
        self.decoded_last_step.reset(slot)

    def outputs_of(self, layer: int, output: torch.Tensor, slots: torch.Tensor
                   ) -> torch.Tensor:
        """[S, B, d] the cached outputs of ``layer`` (zeros where none yet), covering
        ``slots``; output: [n, d] a step's outputs of the layer (its width and device)."""
        table = self.outputs.get(layer)
        if table is None:
            table = self.outputs[layer] = SlotTable(
                (self.block_size, output.shape[1]), torch.float32,
                device=output.device)
        return table.covering(slots)

    def record(self, blocks: StepBlocks, commits: torch.Tensor) -> None:
        """After a step's decision (``commits`` [R, B] bool): records every computed
        position's confidence (0 where it was already decoded, or is decoded now) and the
        decoded positions, for the next step's importance."""
        slots = slot_index(blocks.requests)  # [R]
        confidence = self.confidence.covering(slots)  # [S, B]
        computed = blocks.confidence > float("-inf")  # [R, B]
        observed = torch.where(blocks.available & ~commits, blocks.confidence, 0.0)
        confidence[slots] = torch.where(computed, observed, confidence[slots])
        self.decoded_last_step.covering(slots)[slots] = commits
        for request in blocks.requests:
            state = request.policy_state
            if state.reads_first_token:  # the block's rows are still to be computed
                state.first_token_steps += 1
            else:
                state.kv_lost = False
