"""FOCUS (arXiv 2601.23278): evict a block's non-decodable candidates after an early layer
(``hooks.py``: importance at layers ``eviction_layer - 1`` and ``eviction_layer``, top-K by
its delta), reuse decoded positions' KV by the neighbour-aware intra-block cache, and
unmask like ``standard`` among the retained positions. Options, the authors' variants,
the delayed commit and shifted logits: docs/policies.md, "focus".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from vllm_diffusion.capabilities import ModelCapabilities, PolicyTraits
from vllm_diffusion.kernels.selection import CONTEXT_RULES
from vllm_diffusion.options import OptionError, Rule, option, option_value
from vllm_diffusion.policies.base import BlockStart
from vllm_diffusion.policies.parts.block_cache import IntraBlockCache
from vllm_diffusion.policies.focus.hooks import FocusStepHooks
from vllm_diffusion.policies.parts.strategy_unmasking import StrategyPolicy
from vllm_diffusion.policies.parts.strategy_config import STRATEGIES, StrategyConfig
from vllm_diffusion.step.hooks import ForwardStep, StepHooks
from vllm_diffusion.step.plans import WHOLE_BLOCK, BlockStepPlan
from vllm_diffusion.step.request import DiffusionRequest
from vllm_diffusion.step.slots import SlotTable

DECODE_RATES = ("across_blocks", "per_block")


@dataclasses.dataclass(frozen=True)
class FocusConfig(StrategyConfig):
    # Options a request may not change: committed KV is shared through the prefix cache,
    # and the layers the forward hooks run at are fixed for the engine.
    engine_only: ClassVar[tuple[str, ...]] = (*StrategyConfig.engine_only, "commit",
                                              "eviction_layer")

    strategy: str = option("threshold", Rule(str, choices=STRATEGIES))
    threshold: float = option(0.8, Rule(float, low=0.0, high=1.0))  # the paper's setting
    alpha: float = option(1.5, Rule(float, low=1.0, high=64.0, low_inclusive=False))  # > 1 (paper)
    pool_kernel: int = option(3, Rule(int, low=1, high=15))
    evict: bool = option(True, Rule(bool))
    intra_block_cache: bool = option(True, Rule(bool))
    commit: str = option("exact", Rule(str, choices=("exact", "delayed")))
    eviction_layer: int = option(1, Rule(int, low=1, high=1024))
    decode_rate: str = option("across_blocks", Rule(str, choices=DECODE_RATES))
    context_rule: str = option("retained_left", Rule(str, choices=CONTEXT_RULES))

    def validate_for_block(self, block_size: int, source: str) -> None:
        super().validate_for_block(block_size, source)
        if self.pool_kernel % 2 == 0:
            raise OptionError(f"{source}: option 'pool_kernel' must be odd, got {self.pool_kernel}")
        if self.intra_block_cache:
            self.refuse_editing_with(source, "with FOCUS's 'intra_block_cache' on (the frozen "
                                             "KV of an edited token would be stale)")
        if self.evict:
            self.refuse_editing_with(source, "with FOCUS's 'evict' on (evicted positions get "
                                             "no new proposal)")

    @classmethod
    def traits(cls, options: Mapping[str, Any]) -> PolicyTraits:
        value = functools.partial(option_value, cls, options)
        partial = (value("evict") or value("intra_block_cache") or value("commit") != "exact")
        return dataclasses.replace(super().traits(options), partial_blocks=(
            "it computes whole blocks only with its full budget: set 'evict' and "
            "'intra_block_cache' to false and keep commit='exact'") if partial else None,
            skips_rows=bool(value("evict")), shifted_logits=True,
            shifted_partial_blocks=value("commit") == "exact")


@dataclasses.dataclass
class FocusRequestState:
    """FOCUS state of one request (which of its block's positions were ever processed is
    its slot's row of the policy's ``ever_processed`` table)."""

    block_size: int
    decoded_steps: int = 0
    decoded_tokens: int = 0
    cache: IntraBlockCache | None = None
    # [B] bool: with commit='delayed', the positions of the block completed last that its
    # commit recomputes (the intra-block cache's unfrozen ones), until the commit is planned
    commit_recompute: torch.Tensor | None = None

    def start_block(self, resumed: bool, config: FocusConfig) -> None:
        """Begin (or, when its KV was lost to a preemption, restart) the block."""
        if not resumed and config.decode_rate == "per_block":
            self.decoded_steps = self.decoded_tokens = 0
        self.cache = IntraBlockCache(self.block_size)

    @property
    def mean_decoded(self) -> float:
        """Running mean of tokens decoded per step (1 before the first step)."""
        return self.decoded_tokens / self.decoded_steps if self.decoded_steps else 1.0

    def after_step(self, masked_before: torch.Tensor, computed: torch.Tensor,
                   num_decoded: int, config: FocusConfig) -> None:
        self.cache.update(masked_before)
        if num_decoded or config.decode_rate == "across_blocks":
            self.decoded_steps += 1
            self.decoded_tokens += num_decoded


FocusRequest = DiffusionRequest[FocusConfig, FocusRequestState]


class FocusPolicy(StrategyPolicy[FocusConfig, FocusRequestState]):
    """Unmasks like ``standard`` among the positions its forward hooks retained."""

    name: ClassVar[str] = "focus"
    config_cls: ClassVar[type] = FocusConfig

    def __init__(self, block_size: int, mask_token_id: int,
                 engine_config: FocusConfig) -> None:
        super().__init__(block_size, mask_token_id, engine_config)
        self.eviction_layer = engine_config.eviction_layer
        # [S, B] bool (host): the positions of each slot's block that went through every
        # layer at some step of the block (so their KV is valid at all layers)
        self.ever_processed = SlotTable((block_size,), torch.bool)

    def bind(self, model: ModelCapabilities, hf_config: Any, prefix_caching: bool) -> None:
        super().bind(model, hf_config, prefix_caching)
        num_layers = hf_config.num_hidden_layers
        if num_layers <= self.eviction_layer:
            raise ValueError(f"the focus policy evicts after layer {self.eviction_layer} "
                             f"(option 'eviction_layer'); the model has {num_layers} layer(s)")
        if self.engine_config.commit == "delayed" and prefix_caching:
            raise ValueError(
                "commit='delayed' leaves committed KV approximate, so it must not be shared "
                "through the prefix cache; add --no-enable-prefix-caching "
                "(enable_prefix_caching=False)")

    def new_state(self, config: FocusConfig) -> FocusRequestState:
        return FocusRequestState(self.block_size)

    def plan_step(self, request: FocusRequest, start: BlockStart) -> BlockStepPlan:
        state, config = request.policy_state, request.policy_config
        if start is not None:
            state.start_block(start == "resumed", config)
            self.ever_processed.reset(request.slot)
        commit_recompute, state.commit_recompute = state.commit_recompute, None
        compute = state.cache.processing_set() if config.intra_block_cache else None
        if compute is None and commit_recompute is None:
            return WHOLE_BLOCK
        return BlockStepPlan(compute, commit_recompute=commit_recompute)

    def forward_hooks(self, step: ForwardStep) -> StepHooks | None:
        if not any(s.request is not None and s.request.policy_config.evict
                   and not s.request.keep_all_rows for s in step.requests):
            return None
        return FocusStepHooks(step, self.eviction_layer, self.mask_token_id,
                              self.ever_processed)

    def after_step(self, request: FocusRequest, masked_before: torch.Tensor,
                   computed: torch.Tensor, num_decoded: int, block_done: bool) -> None:
        state = request.policy_state
        state.after_step(masked_before, computed, num_decoded, request.policy_config)
        self.ever_processed.covering(request.slot)[request.slot] |= computed
        if block_done and request.policy_config.commit == "delayed":
            state.commit_recompute = state.cache.uncached.clone()
