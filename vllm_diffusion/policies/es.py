"""ES-dLLM: skip low-importance block positions after early layers (Zhu et al., "ES-dLLM:
Efficient Inference for Diffusion Large Language Models by Early-Skipping", sections
5.1-5.2, Algorithm 1), inside the current block of a block-diffusion model.

At each layer ``l`` of ``skip_layers``, after the layer's output H_l, every block position
still in the forward gets the importance (Eq. 1)

    I = alpha * c_prev + (1 - alpha) * ||H_l - H_l'||_1 / (sqrt(d) * ||H_l'||_2)

where H_l' is the position's output of that layer the last time it was computed in this
block and c_prev its confidence at the last step it reached the logits (0 when it was
already decoded then). The variation term is divided by its largest value over the
positions when that exceeds 1 (the authors' code). The top ``floor((1 - skip_ratio) *
n)`` of the n positions entering the layer continue (ties to the left; at least one), the
others leave the forward for this step: their KV at the later layers stays what the last
step that computed them wrote (still attended to), and their cached confidence is kept for
the next step's ranking. Only positions that reached the logits may be committed, by the
standard strategies. The masked position with the highest c_prev always continues, so every
step can commit (the authors' code adds further bonuses, for the leftmost masked position,
the two most confident and the just-decoded positions, which are not in the paper and not
here).

Steps that compute every position through every layer (and refresh the caches): the
block's first step, a step after the block's KV was lost (preemption), every
``refresh_period``-th step of the block (the paper's periodic refresh; off by default), and
the block's last allowed step (so ``denoising_steps`` holds). The committed prefix's KV is
exact (committed blocks are re-encoded as in ``standard``), so the paper's prompt refresh
has nothing to do here.

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
    engine_only: ClassVar[tuple[str, ...]] = ("skip_layers",)

    alpha: float = option(0.5, Rule(float, low=0.0, high=1.0))
    skip_ratio: float = option(0.5, Rule(float, low=0.0, high=1.0))  # below 1
    # Layers after whose output positions are skipped; None: the paper's depths.
    skip_layers: tuple[int, ...] | None = option(
        None, Rule(tuple, low=0, high=1023, optional=True))
    # Every n-th step of a block computes everything; None: only the first.
    refresh_period: int | None = option(None, Rule(int, low=1, high=4096, optional=True))

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


@dataclasses.dataclass
class EsState:
    """Per request: the current block's caches."""

    block_size: int
    fresh: bool = True  # no step of this block has completed since its caches were reset
    full_step: bool = True  # this step computes every position through every layer
    # [B] float32 (host): each position's confidence at the last step it reached the logits
    confidence: torch.Tensor | None = None
    # layer -> [B, hidden] float32 (model device): each position's last output of the layer
    hidden: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def start_block(self) -> None:
        self.fresh = True
        self.confidence = torch.zeros(self.block_size)
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


class EsHooks(StepHooks):
    """The step's skipping, over every block at once: at each skip layer the entries are
    the positions still in the forward, flat over the blocks (``segment``: their block).
    Made only for steps with at least one block."""

    def __init__(self, step: ForwardStep, skip_layers: tuple[int, ...],
                 mask_token_id: int) -> None:
        self.layers = LayerHooks(after_output=skip_layers)
        self.requests = [s for s in step.requests if s.request is not None]
        self.states = [s.request.policy_state for s in self.requests]
        configs = [s.request.policy_config for s in self.requests]
        self.alpha = torch.tensor([c.alpha for c in configs])
        self.keep_share = torch.tensor([1.0 - c.skip_ratio for c in configs],
                                       dtype=torch.float64)
        self.skipping = torch.tensor([not state.full_step for state in self.states])
        if bool(self.skipping.any()):
            # [R, B] (host): positions masked, and each one's confidence at its last step
            self.masked = torch.stack([s.request.canvas.masked(mask_token_id)
                                       for s in self.requests])
            self.confidence = torch.stack([state.confidence for state in self.states])
        # Per block, its computed positions still in the forward (indices into them).
        self.alive = [torch.arange(len(s.block_positions)) for s in self.requests]

    def after_output(self, layer_input: LayerInput) -> RowSelection | None:
        layer, hidden = layer_input.layer, layer_input.hidden
        device, count = hidden.device, len(self.requests)
        block_positions = [s.block_positions[a] for s, a in zip(self.requests, self.alive)]
        sizes = torch.tensor([len(p) for p in block_positions])
        segment = torch.repeat_interleave(torch.arange(count), sizes)  # [n]
        positions = torch.cat(block_positions)
        step_rows = torch.cat([s.block_rows[a] for s, a in zip(self.requests, self.alive)])
        output = hidden[layer_input.current_rows(step_rows).to(device)].float()  # [n, d]
        # Each block's previous outputs of this layer, then its cache updated in place.
        previous = []
        for state, where, rows in zip(self.states, block_positions,
                                      output.split(sizes.tolist())):
            cache = state.hidden.get(layer)
            if cache is None:
                cache = state.hidden[layer] = rows.new_zeros(state.block_size, rows.shape[1])
            where = where.to(device)
            previous.append(cache[where])
            cache[where] = rows
        if not bool(self.skipping.any()):
            return None
        confidence = self.confidence[segment, positions]  # [n] (host)
        alpha = self.alpha[segment].to(device)
        importance = (alpha * confidence.to(device) + (1 - alpha) * variation(
            output, torch.cat(previous), segment.to(device), count)).cpu()
        # The most confident masked position of each block always continues.
        masked = self.masked[segment, positions]
        by_confidence = first_by_segment(torch.where(masked, confidence, -1.0), segment)
        starts = torch.cumsum(sizes, 0) - sizes
        best = by_confidence[starts]  # every block keeps at least one position
        importance[best[masked[best]]] = float("inf")
        order = first_by_segment(importance, segment)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order)) - starts[segment[order]]
        # floor((1 - skip_ratio) * n) continue, at least one
        keep_counts = torch.floor(self.keep_share * sizes).long().clamp(min=1)
        continuing = (rank < keep_counts[segment]) | ~self.skipping[segment]
        if bool(continuing.all()):
            return None
        keep = torch.ones(len(layer_input.rows), dtype=torch.bool)
        keep[layer_input.current_rows(step_rows[~continuing])] = False
        self.alive = [a[c] for a, c in zip(self.alive, continuing.split(sizes.tolist()))]
        return RowSelection(keep)


EsRequest = DiffusionRequest[EsConfig, EsState]


class EsPolicy(StrategyPolicy[EsConfig, EsState]):
    """Unmasks like ``standard`` among the positions that were not skipped."""

    name: ClassVar[str] = "es"
    config_cls: ClassVar[type] = EsConfig
    drops_rows_in_forward: ClassVar[bool] = True

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
        request.policy_state.start_block()

    def plan_step(self, request: EsRequest) -> BlockStepPlan:
        state, config = request.policy_state, request.policy_config
        step = request.canvas.steps
        period = config.refresh_period
        state.full_step = (state.fresh or config.skip_ratio == 0.0
                           or (period is not None and step % period == 0)
                           or step >= config.steps_for(self.block_size) - 1)
        return WHOLE_BLOCK

    def forward_hooks(self, step: ForwardStep) -> StepHooks | None:
        if not any(s.request is not None for s in step.requests):
            return None
        return EsHooks(step, self.skip_layers, self.mask_token_id)

    def choose_commits(self, batch: CommitBatch) -> torch.Tensor:
        """The strategy's commits among computed positions; then records every computed
        position's confidence (0 where it was already decoded) for the next step."""
        commits = super().choose_commits(batch)
        states = [r.policy_state for r in batch.requests]
        computed = batch.confidence > float("-inf")  # [R, B]
        observed = torch.where(batch.masked, batch.confidence, 0.0)
        updated = torch.where(computed, observed, torch.stack([s.confidence for s in states]))
        for state, confidence in zip(states, updated):
            state.confidence = confidence
            state.fresh = False
        return commits

    def on_block_complete(self, request: EsRequest) -> None:
        request.policy_state.hidden = {}
