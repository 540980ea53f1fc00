"""ES-dLLM (early skipping; Zhu et al., sections 5.1-5.2, Algorithm 1, with the safeguards
of the authors' released code): after each layer of ``skip_layers`` the block positions of
lowest importance (Eq. 1, ``EsHooks.after_output``) leave the forward for the step.
``EsPolicy`` plans whole blocks and unmasks like ``standard`` among the positions kept;
its decision state is in ``state.py``. Options, shifted logits, full attention and every
deviation from the paper: docs/policies.md, "es".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from vllm_diffusion.capabilities import ModelCapabilities, PolicyTraits
from vllm_diffusion.options import OptionError, Rule, option, option_value
from vllm_diffusion.policies.base import BlockStart
from vllm_diffusion.policies.es.state import EsSlotState, EsState
from vllm_diffusion.policies.parts.strategy_unmasking import StrategyPolicy
from vllm_diffusion.policies.parts.strategy_config import StrategyConfig
from vllm_diffusion.policies.rules.blocks import rank_by_score
from vllm_diffusion.step.hooks import (ForwardStep, LayerHooks, LayerInput, RowSelection,
                                       StepHooks)
from vllm_diffusion.step.plans import WHOLE_BLOCK, BlockStepPlan, StepBlocks, StepDecision
from vllm_diffusion.step.request import DiffusionRequest
from vllm_diffusion.step.slots import block_tokens, slot_index

PAPER_DEPTHS = (1 / 8, 1 / 4)
VARIATION_EPS = 1e-6  # added to the L2 norm (the authors' code)


def default_skip_layers(num_layers: int) -> tuple[int, ...]:
    """The paper's depths L/8 and L/4, rounded half up, moved into [2, L - 2]."""
    if num_layers < 4:
        return ()
    chosen = {min(max(math.floor(num_layers * f + 0.5), 2), num_layers - 2)
              for f in PAPER_DEPTHS}
    return tuple(sorted(chosen))


@dataclasses.dataclass(frozen=True)
class EsConfig(StrategyConfig):
    engine_only: ClassVar[tuple[str, ...]] = (*StrategyConfig.engine_only, "skip_layers")

    alpha: float = option(0.5, Rule(float, low=0.0, high=1.0))
    skip_ratio: float = option(0.5, Rule(float, low=0.0, high=1.0))  # below 1
    # Layers after whose output positions are skipped; None: the paper's depths.
    skip_layers: tuple[int, ...] | None = option(
        None, Rule(tuple, low=0, high=1023, optional=True))
    # Every n-th step of a block computes everything; None: only the first.
    refresh_period: int | None = option(4, Rule(int, low=1, high=4096, optional=True))
    # The authors' safeguards: at least min(decoded last step + 2, n) positions continue,
    keep_floor: bool = option(True, Rule(bool))
    # and the leftmost-mask / just-decoded / top-2 importance bonuses.
    priority_bonuses: bool = option(True, Rule(bool))

    def validate_for_block(self, block_size: int, source: str) -> None:
        super().validate_for_block(block_size, source)
        if self.skip_ratio >= 1.0:
            raise OptionError(f"{source}: option 'skip_ratio' must be below 1 (the share "
                              f"of positions skipped at each skip layer), got {self.skip_ratio}")
        if self.skip_ratio > 0:
            self.refuse_editing_with(source, "with 'skip_ratio' above 0 (skipped positions get "
                                             "no new proposal)")
        layers = self.skip_layers
        if layers is not None and list(layers) != sorted(set(layers)):
            raise OptionError(f"{source}: option 'skip_layers' must list distinct layers "
                              f"in increasing order, got {list(layers)}")

    @classmethod
    def traits(cls, options: Mapping[str, Any]) -> PolicyTraits:
        """Plans whole blocks and drops rows inside the forward; under full attention it
        skips within the cached window."""
        return dataclasses.replace(
            super().traits(options), partial_blocks=None, shifted_logits=True,
            shifted_partial_blocks=True,
            skips_rows=option_value(cls, options, "skip_ratio") > 0,
            attention_regimes=("block_causal", "full"), cache_modes=("dual",),
            cache_modes_reason=("ES-dLLM skips positions of the block a cached step "
                                "computes alone; 'recompute' and 'prefix' compute the "
                                "positions after it too"))


LEFTMOST_MASK_BONUS, DECODED_BONUS, TOP_CONFIDENCE_BONUS = 5.0, 3.0, 2.0  # the authors'


def keep_count(num_computed: int, depth: int, skip_ratio: float, decoded_last_step: int,
               keep_floor: bool) -> int:
    """Positions that continue past the ``depth``-th skip layer (1-based) of a step that
    computes ``num_computed`` block positions: floor((1 - skip_ratio)^depth * n), at least
    1, and min(decoded_last_step + 2, n) with ``keep_floor``."""
    count = math.floor((1.0 - skip_ratio) ** depth * num_computed + 1e-9)  # float error
    if keep_floor:
        count = max(count, min(decoded_last_step + 2, num_computed))
    return max(count, 1)


def variation(hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """[n] Eq. 1's variation term before the per-block division: ||H - H'||_1 /
    (sqrt(d) * ||H'||_2) of n positions; hidden, previous: [n, d]."""
    return (hidden - previous).abs().sum(dim=-1) / (
        math.sqrt(hidden.shape[-1]) * (previous.norm(dim=-1) + VARIATION_EPS))


class EsHooks(StepHooks):
    """The step's skipping, over every block at once: scores in [R, B] host grids
    (``present``: the positions still in the forward), layer outputs as flat entries
    (``segment``: the block of each) cached in the policy's [S, B, d] slot tables."""

    def __init__(self, step: ForwardStep, skip_layers: tuple[int, ...],
                 mask_token_id: int, slot_state: EsSlotState) -> None:
        self.layers = LayerHooks(after_output=skip_layers)
        self.requests = [s for s in step.requests if s.request is not None]
        self.states = [s.request.policy_state for s in self.requests]
        self.slot_state = slot_state
        requests = [s.request for s in self.requests]
        configs = [r.policy_config for r in requests]
        skipping = [not state.full_step for state in self.states]
        self.skipping = any(skipping)
        # The entries, flat over the blocks (host): the block of each, its block position
        # and its step row; at first every computed position, then those still in the
        # forward.
        num_computed = [len(s.block_positions) for s in self.requests]
        self.segment = torch.repeat_interleave(torch.arange(len(self.requests)),
                                               torch.tensor(num_computed))
        self.positions = torch.cat([s.block_positions for s in self.requests])
        self.step_rows = torch.cat([s.block_rows for s in self.requests])
        self.slot_of_block = slot_index(requests)  # [R] each block's slot
        stale = [r.slot for r, state in zip(requests, self.states) if state.stale_outputs]
        for table in slot_state.outputs.values():
            table.reset(stale)
        for state in self.states:
            state.stale_outputs = False
        if not self.skipping:
            return
        # [R, B] (host): positions in the forward, masked, each one's confidence at its
        # last step, and the importance bonus of each (0 without the authors' bonuses)
        masked = block_tokens([r.canvas for r in requests]) == mask_token_id
        self.present = torch.zeros(masked.shape, dtype=torch.bool)
        self.present[self.segment, self.positions] = True
        slots = self.slot_of_block
        self.confidence = slot_state.confidence.covering(slots)[slots]
        decoded = slot_state.decoded_last_step.covering(slots)[slots]
        alpha = torch.tensor([c.alpha for c in configs])[:, None]  # [R, 1]
        uses = torch.tensor([c.priority_bonuses for c in configs])[:, None]
        self.alpha_terms = (alpha, 1 - alpha)
        # the positions whose rows the previous step's decoded tokens are in: where logits
        # are shifted, a token's row decodes the position after it
        refreshed = decoded
        shifted = [i for i, s in enumerate(self.requests) if s.logits_shift]
        if shifted:
            refreshed = decoded.clone()
            refreshed[shifted] = False
            refreshed[shifted, 1:] = decoded[shifted, :-1]
        self.bonus = self._fixed_bonuses(masked, refreshed, uses, alpha)
        self.top_two_bonus = (uses & (alpha > 0.0)) * TOP_CONFIDENCE_BONUS  # [R, 1]
        # Without the bonuses, the most confident masked position of each block continues.
        self.guarded = masked & ~uses if not bool(uses.all()) else None
        self.not_skipping = ~torch.tensor(skipping)[:, None]
        # [R] per skip layer: the positions that continue past it (keep floor: the
        # positions each block's previous step decoded)
        decoded_counts = decoded.sum(dim=1).tolist()
        self.keep_counts = {layer: torch.tensor([
            keep_count(n, depth, c.skip_ratio, d, c.keep_floor)
            for n, c, d in zip(num_computed, configs, decoded_counts)])[:, None]
            for depth, layer in enumerate(skip_layers, start=1)}

    def _fixed_bonuses(self, masked: torch.Tensor, decoded: torch.Tensor, uses: torch.Tensor,
                       alpha: torch.Tensor) -> torch.Tensor:
        """[R, B] the bonuses that do not depend on the layer: leftmost masked position,
        the rows of the tokens decoded by the previous step (``decoded``: [R, B])."""
        bonus = torch.zeros(masked.shape)
        rows = torch.nonzero(masked.any(dim=1) & uses[:, 0]).flatten()
        leftmost = masked.int().argmax(dim=1)  # the first masked position
        bonus[rows, leftmost[rows]] += LEFTMOST_MASK_BONUS
        return bonus + (decoded & uses & (alpha < 1.0)) * DECODED_BONUS

    def after_output(self, layer_input: LayerInput) -> RowSelection | None:
        layer, hidden = layer_input.layer, layer_input.hidden
        device = hidden.device
        output = hidden[layer_input.current_rows(self.step_rows).to(device)].float()  # [n, d]
        caches = self.slot_state.outputs_of(layer, output, self.slot_of_block)  # [S, B, d]
        # each entry's (slot, block position): its cached output's place
        where = (self.slot_of_block[self.segment].to(device), self.positions.to(device))
        if not self.skipping:
            caches[where] = output
            return None
        grid = (self.segment, self.positions)  # the entries' places in the [R, B] grids
        change = torch.zeros(self.present.shape).index_put_(
            grid, variation(output, caches[where]).cpu())
        # Eq. 1, the variation term divided by its block's maximum when that exceeds 1
        alpha, rest = self.alpha_terms
        importance = (alpha * self.confidence
                      + rest * change / change.amax(dim=1, keepdim=True).clamp(min=1.0)
                      + self.bonus)
        absent = ~self.present
        importance += ((rank_by_score(self.confidence.masked_fill(absent, -math.inf))[1] < 2)
                       * self.top_two_bonus)
        if self.guarded is not None:
            best = torch.where(self.guarded, self.confidence, -1.0).masked_fill(
                absent, -math.inf).argmax(dim=1, keepdim=True)
            importance.scatter_(1, best, torch.where(
                self.guarded.gather(1, best), math.inf, importance.gather(1, best)))
        continuing = self.present & (
            (rank_by_score(importance.masked_fill(absent, -math.inf))[1]
             < self.keep_counts[layer]) | self.not_skipping)  # [R, B]
        kept = continuing[grid]  # [n]
        # The caches of the positions that continue (the authors' update rule).
        on_device = kept.to(device)
        caches[where[0][on_device], where[1][on_device]] = output[on_device]
        if bool(kept.all()):
            return None
        keep = torch.ones(len(layer_input.rows), dtype=torch.bool)
        keep[layer_input.current_rows(self.step_rows[~kept])] = False
        self.present = continuing
        self.segment, self.positions = self.segment[kept], self.positions[kept]
        self.step_rows = self.step_rows[kept]
        return RowSelection(keep)


EsRequest = DiffusionRequest[EsConfig, EsState]


class EsPolicy(StrategyPolicy[EsConfig, EsState]):
    """Unmasks like ``standard`` among the positions that were not skipped."""

    name: ClassVar[str] = "es"
    config_cls: ClassVar[type] = EsConfig
    confidence_rule: ClassVar[str] = "max_probability"

    def __init__(self, block_size: int, mask_token_id: int,
                 engine_config: EsConfig) -> None:
        super().__init__(block_size, mask_token_id, engine_config)
        self.skip_layers: tuple[int, ...] = engine_config.skip_layers or ()
        self.slot_state = EsSlotState(block_size)

    def bind(self, model: ModelCapabilities, hf_config: Any, prefix_caching: bool) -> None:
        super().bind(model, hf_config, prefix_caching)
        num_layers = hf_config.num_hidden_layers
        layers = self.engine_config.skip_layers
        if layers is None:
            layers = default_skip_layers(num_layers)
            if not layers:
                raise ValueError(f"the es policy skips after layers 2..L-2; the model has "
                                 f"{num_layers} layer(s) (at least 4 needed, or set "
                                 f"'skip_layers')")
        elif layers[-1] > num_layers - 2:
            raise ValueError(f"option 'skip_layers' {list(layers)}: skipping after layer "
                             f"{layers[-1]} needs a later layer; the model has {num_layers} "
                             f"layer(s) (valid: 0..{num_layers - 2})")
        self.skip_layers = tuple(layers)

    def new_state(self, config: EsConfig) -> EsState:
        return EsState()

    def plan_step(self, request: EsRequest, start: BlockStart) -> BlockStepPlan:
        state, config = request.policy_state, request.policy_config
        if start is not None:
            # a resumed block keeps its decision state; its KV is recomputed
            state.kv_lost = True
            if not (start == "resumed" and state.started):
                self.slot_state.start_block(request.slot)
                state.started = state.stale_outputs = True
                state.first_token_steps = 0
        state.reads_first_token = (self.model.shifted_logits and
                                   int(request.canvas.tokens[0]) == self.mask_token_id)
        step = request.canvas.steps - state.first_token_steps  # the denoising steps
        period = config.refresh_period
        state.full_step = (state.kv_lost or config.skip_ratio == 0.0
                           or request.keep_all_rows
                           or (period is not None and step % period == 0)
                           or step >= config.steps_for(self.block_size) - 1)
        return WHOLE_BLOCK

    def forward_hooks(self, step: ForwardStep) -> StepHooks | None:
        if not any(s.request is not None for s in step.requests):
            return None
        return EsHooks(step, self.skip_layers, self.mask_token_id, self.slot_state)

    def decide(self, blocks: StepBlocks) -> StepDecision:
        """The rules' decision among the positions the forward did not skip; then records
        what the next step's importance reads (``EsSlotState.record``)."""
        decision = super().decide(blocks)
        self.slot_state.record(blocks, decision.commits)
        return decision
