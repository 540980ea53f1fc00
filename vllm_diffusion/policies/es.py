"""ES-dLLM: skip low-importance block positions after early layers (Zhu et al., "ES-dLLM:
Efficient Inference for Diffusion Large Language Models by Early-Skipping", sections
5.1-5.2, Algorithm 1, Appendix B; the authors' released code, zhuzj19/ES-dLLM), inside the
current block of a block-diffusion model.

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

Default ``skip_layers``: the paper's depths 1/8 and 1/4 of the layers (layers 4 and 8 of
LLaDA's 32), rounded half up, then moved into [2, L - 2] so that layers 0-1 (whose outputs
barely depend on context in a shallow model) and the last layer are never skip points: 12
layers -> (2, 3); the 4-layer tiny model -> (2,).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from vllm_diffusion.options import OptionError, Rule, option
from vllm_diffusion.policies.unmasking import StrategyConfig, StrategyPolicy
from vllm_diffusion.step.hooks import (ForwardStep, LayerHooks, LayerInput, RowSelection,
                                       StepHooks)
from vllm_diffusion.step.plans import WHOLE_BLOCK, BlockStepPlan, CommitBatch
from vllm_diffusion.step.request import DiffusionRequest

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


LEFTMOST_MASK_BONUS, DECODED_BONUS, TOP_CONFIDENCE_BONUS = 5.0, 3.0, 2.0  # the authors'


def keep_count(num_computed: int, depth: int, skip_ratio: float, decoded_last_step: int,
               keep_floor: bool) -> int:
    """Positions that continue past the ``depth``-th skip layer (1-based) of a step that
    computes ``num_computed`` block positions (see the module doc)."""
    count = math.floor((1.0 - skip_ratio) ** depth * num_computed + 1e-9)
    if keep_floor:
        count = max(count, min(decoded_last_step + 2, num_computed))
    return max(count, 1)


@dataclasses.dataclass
class EsState:
    """Per request: the current block's caches."""

    block_size: int
    full_step: bool = True  # this step computes every position through every layer
    kv_lost: bool = True  # no step has computed the block since its KV was (re)allocated
    # [B] float32 (host): each position's confidence at the last step it reached the logits
    confidence: torch.Tensor | None = None
    # [B] bool (host): the positions the previous step decoded
    decoded_last_step: torch.Tensor | None = None
    # layer -> [B, hidden] float32 (model device): each position's last output of the layer
    hidden: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def start_block(self) -> None:
        self.kv_lost = True
        self.confidence = torch.zeros(self.block_size)
        self.decoded_last_step = torch.zeros(self.block_size, dtype=torch.bool)
        self.hidden = {}


def variation(hidden: torch.Tensor, previous: torch.Tensor,
              segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    """[n] Eq. 1's variation term of n positions of ``num_segments`` blocks (``segment``:
    [n] the block of each); hidden, previous: [n, d]. Divided, per block, by its maximum
    when that exceeds 1."""
    width = hidden.shape[-1]
    change = (hidden - previous).abs().sum(dim=-1) / (
        math.sqrt(width) * (previous.norm(dim=-1) + VARIATION_EPS))
    largest = torch.ones(num_segments, device=change.device, dtype=change.dtype).scatter_reduce(
        0, segment, change, reduce="amax")  # max(1, the block's maximum)
    return change / largest[segment]


def first_by_segment(score: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """[n] the order of n entries by segment, then score descending, then index (host)."""
    by_score = torch.sort(score, descending=True, stable=True).indices
    return by_score[torch.sort(segment[by_score], stable=True).indices]


def rank_in_segment(score: torch.Tensor, segment: torch.Tensor,
                    starts: torch.Tensor) -> torch.Tensor:
    """[n] each entry's rank within its segment by score descending (ties to the left)."""
    order = first_by_segment(score, segment)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order)) - starts[segment[order]]
    return rank


class EsHooks(StepHooks):
    """The step's skipping, over every block at once: at each skip layer the entries are
    the positions still in the forward, flat over the blocks (``segment``: their block).
    Made only for steps with at least one block."""

    def __init__(self, step: ForwardStep, skip_layers: tuple[int, ...],
                 mask_token_id: int) -> None:
        self.layers = LayerHooks(after_output=skip_layers)
        self.depth = {layer: j + 1 for j, layer in enumerate(skip_layers)}
        self.requests = [s for s in step.requests if s.request is not None]
        self.states = [s.request.policy_state for s in self.requests]
        self.configs = [s.request.policy_config for s in self.requests]
        self.alpha = torch.tensor([c.alpha for c in self.configs])
        self.skipping = torch.tensor([not state.full_step for state in self.states])
        self.num_computed = [len(s.block_positions) for s in self.requests]
        self.uses_bonuses = torch.tensor([c.priority_bonuses for c in self.configs])
        if bool(self.skipping.any()):
            # [R, B] (host): positions masked, each one's confidence at its last step, and
            # the importance bonus of each (0 without the authors' bonuses)
            self.masked = torch.stack([s.request.canvas.masked(mask_token_id)
                                       for s in self.requests])
            self.confidence = torch.stack([state.confidence for state in self.states])
            self.bonus = self._fixed_bonuses()
            # positions each block's previous step decoded (the keep floor's d)
            self.decoded_counts = [int(s.decoded_last_step.sum()) for s in self.states]
        # Per block, its computed positions still in the forward (indices into them).
        self.alive = [torch.arange(len(s.block_positions)) for s in self.requests]

    def _fixed_bonuses(self) -> torch.Tensor:
        """[R, B] the bonuses that do not depend on the layer: leftmost masked position,
        positions decoded by the previous step."""
        bonus = torch.zeros(self.masked.shape)
        uses = self.uses_bonuses
        has_mask = self.masked.any(dim=1) & uses
        leftmost = self.masked.int().argmax(dim=1)  # the first masked position
        rows = torch.nonzero(has_mask).flatten()
        bonus[rows, leftmost[rows]] += LEFTMOST_MASK_BONUS
        decoded = torch.stack([s.decoded_last_step for s in self.states])
        decoded &= (uses & (self.alpha < 1.0))[:, None]
        return bonus + decoded * DECODED_BONUS

    def after_output(self, layer_input: LayerInput) -> RowSelection | None:
        layer, hidden = layer_input.layer, layer_input.hidden
        device, count = hidden.device, len(self.requests)
        block_positions = [s.block_positions[a] for s, a in zip(self.requests, self.alive)]
        sizes = torch.tensor([len(p) for p in block_positions])
        segment = torch.repeat_interleave(torch.arange(count), sizes)  # [n]
        positions = torch.cat(block_positions)
        step_rows = torch.cat([s.block_rows[a] for s, a in zip(self.requests, self.alive)])
        output = hidden[layer_input.current_rows(step_rows).to(device)].float()  # [n, d]
        caches = []
        for state in self.states:
            if layer not in state.hidden:
                state.hidden[layer] = output.new_zeros(state.block_size, output.shape[1])
            caches.append(state.hidden[layer])
        if not bool(self.skipping.any()):
            self._store(caches, block_positions, output, sizes)
            return None
        previous = torch.cat([cache[where.to(device)]
                              for cache, where in zip(caches, block_positions)])
        confidence = self.confidence[segment, positions]  # [n] (host)
        alpha = self.alpha[segment]
        importance = (alpha * confidence + (1 - alpha) * variation(
            output, previous, segment.to(device), count).cpu())
        importance += self.bonus[segment, positions]
        starts = torch.cumsum(sizes, 0) - sizes
        uses = self.uses_bonuses
        top_two = (rank_in_segment(confidence, segment, starts) < 2) & (
            uses & (self.alpha > 0.0))[segment]
        importance += top_two * TOP_CONFIDENCE_BONUS
        # Without the bonuses, the most confident masked position of each block continues.
        masked = self.masked[segment, positions]
        by_confidence = first_by_segment(torch.where(masked, confidence, -1.0), segment)
        best = by_confidence[starts]
        best = best[masked[best] & ~uses[segment[best]]]
        importance[best] = float("inf")
        depth = self.depth[layer]
        keep_counts = torch.tensor([
            keep_count(n, depth, c.skip_ratio, decoded, c.keep_floor)
            for n, c, decoded in zip(self.num_computed, self.configs, self.decoded_counts)])
        continuing = ((rank_in_segment(importance, segment, starts) < keep_counts[segment])
                      | ~self.skipping[segment])
        # The caches of the positions that continue (the authors' update rule).
        self._store(caches, block_positions, output, sizes, continuing)
        if bool(continuing.all()):
            return None
        keep = torch.ones(len(layer_input.rows), dtype=torch.bool)
        keep[layer_input.current_rows(step_rows[~continuing])] = False
        self.alive = [a[c] for a, c in zip(self.alive, continuing.split(sizes.tolist()))]
        return RowSelection(keep)

    @staticmethod
    def _store(caches: list[torch.Tensor], block_positions: list[torch.Tensor],
               output: torch.Tensor, sizes: torch.Tensor,
               continuing: torch.Tensor | None = None) -> None:
        """Write each block's outputs of this layer into its cache (only ``continuing``)."""
        split = sizes.tolist()
        kept = continuing.split(split) if continuing is not None else [None] * len(caches)
        for cache, where, rows, keep in zip(caches, block_positions, output.split(split), kept):
            if keep is not None:
                where, rows = where[keep], rows[keep.to(rows.device)]
            cache[where.to(rows.device)] = rows


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

    def bind_model(self, hf_config: Any, prefix_caching: bool) -> None:
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
        return EsState(self.block_size)

    def start_block(self, request: EsRequest, resumed: bool) -> None:
        state = request.policy_state
        if resumed and state.confidence is not None:
            state.kv_lost = True  # the decision state stays; the KV must be recomputed
        else:
            state.start_block()

    def plan_step(self, request: EsRequest) -> BlockStepPlan:
        state, config = request.policy_state, request.policy_config
        step = request.canvas.steps
        period = config.refresh_period
        # A request with a grammar skips nothing: the grammar's walk starts at the
        # leftmost undecided position and checks the positions right of it.
        state.full_step = (state.kv_lost or config.skip_ratio == 0.0
                           or request.grammar is not None
                           or (period is not None and step % period == 0)
                           or step >= config.steps_for(self.block_size) - 1)
        return WHOLE_BLOCK

    def forward_hooks(self, step: ForwardStep) -> StepHooks | None:
        if not any(s.request is not None for s in step.requests):
            return None
        return EsHooks(step, self.skip_layers, self.mask_token_id)

    def choose_commits(self, batch: CommitBatch) -> torch.Tensor:
        """The strategy's commits among computed positions; then records every computed
        position's confidence (0 where it was already decoded, or is decoded now) and the
        decoded positions for the next step."""
        commits = super().choose_commits(batch)
        states = [r.policy_state for r in batch.requests]
        computed = batch.confidence > float("-inf")  # [R, B]
        observed = torch.where(batch.masked & ~commits, batch.confidence, 0.0)
        updated = torch.where(computed, observed, torch.stack([s.confidence for s in states]))
        for state, confidence, decoded in zip(states, updated, commits):
            state.confidence = confidence
            state.decoded_last_step = decoded.clone()
            state.kv_lost = False
        return commits

    def on_block_complete(self, request: EsRequest) -> None:
        request.policy_state.hidden = {}
