"""Ada-DLM (adaptive freezing; Li et al., section 4.2, Algorithm 1 of appendix B), inside
the current block: each step, the masked positions whose confidence trajectory is nearer
the most confident position's than the boundary's are frozen, i.e. committed
(``batched_freeze_positions``); ``AdaPolicy`` keeps the trajectories in slot tables and
plans the intra-block cache. The rule's details, the options not the paper's, freeze rules
and measurements: docs/policies.md, "ada".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from vllm_diffusion.capabilities import PolicyTraits
from vllm_diffusion.options import Rule, option, option_value
from vllm_diffusion.policies.base import BlockStart, DecodingPolicy, PolicyConfig
from vllm_diffusion.policies.parts.block_cache import RULES, IntraBlockCache
from vllm_diffusion.step.plans import WHOLE_BLOCK, BlockStepPlan, StepBlocks, StepDecision
from vllm_diffusion.step.request import DiffusionRequest
from vllm_diffusion.step.slots import SlotTable, slot_index


@dataclasses.dataclass(frozen=True)
class AdaConfig(PolicyConfig):
    # K as a share of the block, fixed for the block (the paper: about 15%)
    capacity: float = option(0.15, Rule(float, low=0.0, high=1.0, low_inclusive=False))
    history: int = option(3, Rule(int, low=1, high=16))  # confidence steps per feature
    # False: every step recomputes the whole block (frozen positions included); None: on
    # where the model lets a step compute part of a block (off under full attention)
    intra_block_cache: bool | None = option(None, Rule(bool, optional=True))
    # With the cache, when a frozen position stops being computed (``block_cache.RULES``)
    freeze_rule: str = option("after_recompute", Rule(str, choices=RULES))
    # not the paper's: positions below this confidence stay active (0: the published rule)
    confidence_floor: float = option(0.0, Rule(float, low=0.0, high=1.0))
    # not the paper's: positions above this confidence also freeze, as under the static
    # threshold the paper compares against (Fast-dLLM's 0.9); None: the published rule
    static_threshold: float | None = option(None, Rule(float, low=0.0, high=1.0,
                                                       optional=True))

    @classmethod
    def traits(cls, options: Mapping[str, Any]) -> PolicyTraits:
        """Without the intra-block cache every step computes the whole block: it decodes
        full-attention models (under any cache mode) and shifted logits too."""
        intra_block = option_value(cls, options, "intra_block_cache")
        return PolicyTraits(
            attention_regimes=("block_causal", "full"), shifted_logits=not intra_block,
            partial_blocks=("option 'intra_block_cache' computes part of a block in some "
                            "forwards; remove it") if intra_block else None)


def capacity_count(capacity: float, block_size: int) -> int:
    """K = ceil(capacity * B), at least 1 (a tolerance keeps 0.15 * 20 at 3)."""
    return max(1, math.ceil(capacity * block_size - 1e-9))


def freeze_positions(confidence: torch.Tensor, masked: torch.Tensor,
                     history: torch.Tensor, capacity: float,
                     confidence_floor: float = 0.0,
                     static_threshold: float | None = None) -> torch.Tensor:
    """[B] bool: the masked positions Ada-DLM freezes this step (one block; the plain form
    of ``batched_freeze_positions``). confidence: [B] float, this step's; masked: [B] bool,
    the candidates; history: [B, h] float, row i the feature vector v_i, this step's
    confidence first."""
    frozen = torch.zeros_like(masked)
    candidates = torch.nonzero(masked).flatten()
    num = len(candidates)
    if num == 0:
        return frozen
    order = candidates[torch.sort(confidence[candidates], descending=True, stable=True).indices]
    k = capacity_count(capacity, len(masked))
    high = history[order[0]]
    bound = history[order[k] if k < num else order[num - 1]]
    features = history[candidates]  # [m, h]
    to_high = (features - high).pow(2).sum(dim=1)
    to_bound = (features - bound).pow(2).sum(dim=1)
    clustered = (to_high < to_bound) & (confidence[candidates] >= confidence_floor)
    frozen[candidates[clustered]] = True
    frozen[order[0]] = True
    if static_threshold is not None:
        frozen |= masked & (confidence > static_threshold)
    return frozen


def batched_freeze_positions(confidence: torch.Tensor, masked: torch.Tensor,
                             history: torch.Tensor, capacity: torch.Tensor,
                             confidence_floor: torch.Tensor | None = None,
                             static_threshold: torch.Tensor | None = None) -> torch.Tensor:
    """``freeze_positions`` for R blocks at once (the engine's path; tested against it).
    confidence, masked: [R, B]; history: [R, B, h]; capacity, confidence_floor: [R] float;
    static_threshold: [R] float, NaN for a block without one."""
    rows = torch.arange(masked.shape[0])
    num = masked.sum(dim=1)  # [R]
    scored = torch.where(masked, confidence, torch.full_like(confidence, float("-inf")))
    order = torch.sort(scored, dim=1, descending=True, stable=True).indices  # [R, B]
    k = torch.clamp(torch.ceil(capacity.double() * masked.shape[1] - 1e-9).long(), min=1)
    boundary = torch.where(k < num, k, (num - 1).clamp(min=0))
    high = history[rows, order[:, 0]]  # [R, h]
    bound = history[rows, order[rows, boundary]]  # [R, h]
    to_high = (history - high[:, None]).pow(2).sum(dim=2)  # [R, B]
    to_bound = (history - bound[:, None]).pow(2).sum(dim=2)
    frozen = masked & (to_high < to_bound)
    if confidence_floor is not None:
        frozen &= confidence >= confidence_floor[:, None].to(confidence.dtype)
    frozen[rows, order[:, 0]] |= num > 0
    if static_threshold is not None:  # NaN compares False: no static freezes
        frozen |= masked & (confidence > static_threshold[:, None].to(confidence.dtype))
    return frozen


@dataclasses.dataclass
class AdaState:
    """Per request: its block's intra-block cache (its confidence history is its slot's row
    of the policy's history table for ``history_steps``)."""

    block_size: int
    history_steps: int
    cache: IntraBlockCache | None = None
    started: bool = False  # a block started: the slot's history row is the request's

    def start_block(self, resumed: bool, freeze_rule: str) -> bool:
        """Returns whether the history starts anew (a resumed block keeps it)."""
        self.cache = IntraBlockCache(self.block_size, rule=freeze_rule)
        fresh = not (resumed and self.started)
        self.started = True
        return fresh


AdaRequest = DiffusionRequest[AdaConfig, AdaState]


class AdaPolicy(DecodingPolicy[AdaConfig, AdaState]):
    name: ClassVar[str] = "ada"
    config_cls: ClassVar[type] = AdaConfig
    confidence_rule: ClassVar[str] = "max_probability"

    def uses_intra_block_cache(self, config: AdaConfig) -> bool:
        if config.intra_block_cache is None:
            return not self.model.needs_whole_blocks
        return config.intra_block_cache

    def __init__(self, block_size: int, mask_token_id: int,
                 engine_config: AdaConfig) -> None:
        super().__init__(block_size, mask_token_id, engine_config)
        # history length h -> [S, B, h] float32 (host): each slot's confidence features,
        # newest confidence first (one table per length: requests may choose their own)
        self.histories: dict[int, SlotTable] = {}

    def history_table(self, history_steps: int) -> SlotTable:
        """The history table of the requests keeping ``history_steps`` confidences."""
        table = self.histories.get(history_steps)
        if table is None:
            table = self.histories[history_steps] = SlotTable(
                (self.block_size, history_steps), torch.float32)
        return table

    def new_state(self, config: AdaConfig) -> AdaState:
        return AdaState(self.block_size, config.history)

    def plan_step(self, request: AdaRequest, start: BlockStart) -> BlockStepPlan:
        state = request.policy_state
        if start is not None and state.start_block(start == "resumed",
                                                   request.policy_config.freeze_rule):
            self.history_table(state.history_steps).reset(request.slot)
        if not self.uses_intra_block_cache(request.policy_config):
            return WHOLE_BLOCK
        return BlockStepPlan(request.policy_state.cache.processing_set())

    def decide(self, blocks: StepBlocks) -> StepDecision:
        """Ada-DLM's decision: commits the positions it freezes
        (``batched_freeze_positions``) from each request's confidence history, which it
        updates in the policy's history tables."""
        states = [r.policy_state for r in blocks.requests]
        slots = slot_index(blocks.requests)  # [R]
        lengths = sorted({s.history_steps for s in states})
        commits = torch.zeros_like(blocks.available)
        for length in lengths:  # one batch per history length
            group = [i for i, s in enumerate(states) if s.history_steps == length]
            masked, confidence = blocks.available[group], blocks.confidence[group]
            group_slots = slots[group]
            table = self.history_table(length).covering(group_slots)  # [S, B, h]
            previous = table[group_slots]  # [R', B, h]
            shifted = torch.cat([confidence[..., None], previous[..., :-1]], dim=2)
            history = torch.where(masked[..., None], shifted, previous)
            configs = [blocks.requests[i].policy_config for i in group]
            capacity = torch.tensor([c.capacity for c in configs], dtype=torch.float64)
            floor = torch.tensor([c.confidence_floor for c in configs], dtype=torch.float64)
            static = torch.tensor([math.nan if c.static_threshold is None
                                   else c.static_threshold for c in configs],
                                  dtype=torch.float64)
            commits[group] = batched_freeze_positions(confidence, masked, history, capacity,
                                                      floor, static)
            table[group_slots] = history
        return StepDecision(commits)

    def after_step(self, request: AdaRequest, masked_before: torch.Tensor,
                   computed: torch.Tensor, num_decoded: int, block_done: bool) -> None:
        request.policy_state.cache.update(masked_before,
                                          request.canvas.masked(self.mask_token_id))
