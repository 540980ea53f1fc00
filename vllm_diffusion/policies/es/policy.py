"""ES-dLLM: skip low-importance block positions after early layers (Zhu et al., "ES-dLLM:
Efficient Inference for Diffusion Large Language Models by Early-Skipping", sections
5.1-5.2, Algorithm 1, Appendix B; the authors' released code, zhuzj19/ES-dLLM), inside the
current block of a block-diffusion model, or of a full-attention model's dual cache.

At each layer ``l`` of ``skip_layers``, after the layer's output H_l, every block position
still in the forward gets the importance (Eq. 1)

    I = alpha * c_prev + (1 - alpha) * ||H_l - H_l'||_1 / (sqrt(d) * ||H_l'||_2)

where H_l' is the position's output of that layer the last time it continued past it in
this block and c_prev its confidence (the maximum probability, as the paper defines it)
at the last step it reached the logits (0 when it was already decoded then, and for the
positions decoded by that step). The variation term is divided by its largest value over
the positions when that exceeds 1. With ``priority_bonuses`` (the authors' code; on by
default) the importance is raised by 5 at the block's leftmost masked position, by 3 at
the positions decoded by the previous step (when alpha < 1: their KV is refreshed with
their token) and by 2 at the two positions of highest c_prev (when alpha > 0; ties to the
left). The top ``count_j`` positions continue (ties to the left), the others leave the
forward for this step: their KV at the later layers stays what the last step that
computed them wrote (still attended to), their cached output H_l' and confidence stay
(the authors update the caches of the survivors only), and they are not committed.

``count_j`` at the j-th skip layer (1-based) is floor((1 - skip_ratio)^j * n) of the n
block positions the step computes (the authors' cumulative proportions 1, 0.5, 0.25),
rounded so that binary float error never loses a position, at least 1, and with
``keep_floor`` (the authors' code; on by default) at least min(d + 2, n), d the positions
the request's previous step decoded.

Steps that compute every position through every layer (and refresh the caches): the
block's first step, a step after the block's KV was lost (preemption), every
``refresh_period``-th step of the block (the paper's block refresh, Table 5: every 4 steps
for LLaDA on BBH, HumanEval and MBPP, the authors' scripts' most common setting; the
default), and the block's last allowed step (so ``denoising_steps`` holds).

Where logits are shifted (Fast-dLLM v2's form, the converted default: position j is read
from row j - 1), every entry is the row that decodes a position, a choice the paper (on
LLaDA and Dream's dual cache) does not make: importance, confidence and cached output
belong to the decoded position, the leftmost-mask bonus goes to the row before the
leftmost mask, and the just-decoded bonus to the rows holding the just-decoded tokens
(whose KV it refreshes: position p's token is in the row that decodes p + 1). The block's
last row, which decodes the next block's first token, always continues. The step that
reads the block's first token from the previous block's commit computes none of the
block's rows: it is not one of the block's steps (the block's first step computes
everything, the refresh period counts from it).

Deviations, with their reasons:
- The committed prefix's KV is exact (committed blocks are re-encoded as in ``standard``),
  so the paper's prompt refresh has nothing to act on; the block refresh counts the steps
  of the current block (the authors count steps over the whole generation, and their
  block's first step is not a refresh unless the count says so: their first forward
  computes every future block, ours has no earlier output of a new block to compare with).
- The keep floor uses the request's own decoded count (the authors' batch takes the
  maximum over its requests: one request's choice would depend on its neighbours).
- Without the bonuses the masked position with the highest c_prev always continues, so
  every step can commit (the paper states no such rule; the bonuses make it unnecessary:
  the leftmost masked position continues).
- A preemption frees the block's KV, including the later-layer KV of skipped positions,
  which was computed from an earlier canvas and cannot be rebuilt; the step after it
  computes everything (as a refresh does). The decision state (c_prev, the cached
  outputs, the decoded positions, the block's step count) is kept across it.

On a full-attention model (LLaDA), the paper's own setting: under Fast-dLLM's dual cache
(``diffusion_cache_mode`` ``dual``, required) a block's first step refreshes every
position's KV with a full forward (the paper's prompt refresh; the authors' default
period, the block length, makes it once per block at one token per step) and computes
everything; the later steps compute the block alone, skipping as above.

Default ``skip_layers``: the paper's depths 1/8 and 1/4 of the layers (layers 4 and 8 of
LLaDA's 32), rounded half up, then moved into [2, L - 2] so that layers 0-1 (whose outputs
barely depend on context in a shallow model) and the last layer are never skip points: 12
layers -> (2, 3); the 4-layer tiny model -> (2,).
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
from vllm_diffusion.step.hooks import (ForwardStep, LayerHooks, LayerInput, RowSelection,
                                       StepHooks)
from vllm_diffusion.step.plans import WHOLE_BLOCK, BlockStepPlan, StepBlocks, StepDecision
from vllm_diffusion.step.request import DiffusionRequest
from vllm_diffusion.step.slots import block_tokens, slot_index

PAPER_DEPTHS = (1 / 8, 1 / 4)
VARIATION_EPS = 1e-6  # added to the L2 norm (the authors' code)


def default_skip_layers(num_layers: int) -> tuple[int, ...]:
    """The paper's skip depths for a model of ``num_layers`` layers (see the module doc)."""
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
    computes ``num_computed`` block positions (see the module doc)."""
    count = math.floor((1.0 - skip_ratio) ** depth * num_computed + 1e-9)
    if keep_floor:
        count = max(count, min(decoded_last_step + 2, num_computed))
    return max(count, 1)


def variation(hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """[n] Eq. 1's variation term before the per-block division: ||H - H'||_1 /
    (sqrt(d) * ||H'||_2) of n positions; hidden, previous: [n, d]."""
    return (hidden - previous).abs().sum(dim=-1) / (
        math.sqrt(hidden.shape[-1]) * (previous.norm(dim=-1) + VARIATION_EPS))


def rank_in_blocks(score: torch.Tensor) -> torch.Tensor:
    """[R, B] each position's rank within its block by score descending (ties to the
    left); score: [R, B] (-inf where a position is not in the forward)."""
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(
        1, order, torch.arange(score.shape[1]).expand_as(order).contiguous())


class EsHooks(StepHooks):
    """The step's skipping, over every block at once. The scores live on the host as [R, B]
    grids over the blocks' positions (``present``: the positions still in the forward);
    the layer outputs are gathered as flat entries (``segment``: the block of each), whose
    cached outputs are read and written in place in the policy's [S, B, d] slot tables at
    (the block's slot, the position). Made only for steps with at least one block."""

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
        importance += ((rank_in_blocks(self.confidence.masked_fill(absent, -math.inf)) < 2)
                       * self.top_two_bonus)
        if self.guarded is not None:
            best = torch.where(self.guarded, self.confidence, -1.0).masked_fill(
                absent, -math.inf).argmax(dim=1, keepdim=True)
            importance.scatter_(1, best, torch.where(
                self.guarded.gather(1, best), math.inf, importance.gather(1, best)))
        continuing = self.present & (
            (rank_in_blocks(importance.masked_fill(absent, -math.inf))
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
