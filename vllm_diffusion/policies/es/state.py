"""ES-dLLM's decision state and its decision (the ``es`` policy, ``policy.py``): per request
where its block stands (``EsState``), per slot each position's last confidence, the
positions the previous step decoded and the skip layers' cached outputs
(``EsSlotState``), and the strategy decision that records the confidences and the decoded
positions (``EsUnmasking``)."""

from __future__ import annotations

import dataclasses

import torch

from vllm_diffusion.capabilities import ModelCapabilities
from vllm_diffusion.policies.parts.strategy_unmasking import StrategyUnmasking
from vllm_diffusion.step.plans import CommitBatch
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


class EsUnmasking(StrategyUnmasking):
    """``StrategyUnmasking`` among the positions the forward did not skip, recording what
    the next step's importance reads into the policy's ``EsSlotState``."""

    def __init__(self, block_size: int, mask_token_id: int, model: ModelCapabilities,
                 slot_state: EsSlotState) -> None:
        super().__init__(block_size, mask_token_id, model)
        self.slot_state = slot_state

    def choose_commits(self, batch: CommitBatch) -> torch.Tensor:
        """The strategy's commits among computed positions; then records every computed
        position's confidence (0 where it was already decoded, or is decoded now) and the
        decoded positions for the next step."""
        commits = super().choose_commits(batch)
        slots = slot_index(batch.requests)  # [R]
        confidence = self.slot_state.confidence.covering(slots)  # [S, B]
        computed = batch.confidence > float("-inf")  # [R, B]
        observed = torch.where(batch.masked & ~commits, batch.confidence, 0.0)
        confidence[slots] = torch.where(computed, observed, confidence[slots])
        self.slot_state.decoded_last_step.covering(slots)[slots] = commits
        for request in batch.requests:
            state = request.policy_state
            if state.reads_first_token:  # the block's rows are still to be computed
                state.first_token_steps += 1
            else:
                state.kv_lost = False
        return commits
