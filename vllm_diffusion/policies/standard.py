"""Standard block-diffusion decoding: every step computes the whole block, the chunk window
(``parts/chunk_window.py``) or the active sub-block (``parts/sub_block_cache.py``), and
unmasks by one of the rules of ``rules/``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from vllm_diffusion.capabilities import PolicyTraits
from vllm_diffusion.options import OptionError, Rule, option, option_value
from vllm_diffusion.policies.base import BlockStart
from vllm_diffusion.policies.parts.chunk_window import ChunkConfig, ChunkWindow
from vllm_diffusion.policies.parts.strategy_unmasking import StrategyPolicy
from vllm_diffusion.policies.parts.sub_block_cache import SubBlockCache
from vllm_diffusion.step.plans import BlockStepPlan
from vllm_diffusion.step.request import DiffusionRequest


@dataclasses.dataclass(frozen=True)
class StandardConfig(ChunkConfig):
    """The strategy and chunk-window options, and Fast-dLLM v2's block cache
    (``parts/sub_block_cache.py``)."""

    sub_block_cache: bool = option(False, Rule(bool))

    def validate_for_block(self, block_size: int, source: str) -> None:
        super().validate_for_block(block_size, source)
        if not self.sub_block_cache:
            return
        if self.chunk_size is not None or self.chunk_reuse:
            raise OptionError(f"{source}: option 'sub_block_cache' cannot be combined with "
                              f"'chunk_size' or 'chunk_reuse' (both choose the rows a step "
                              f"computes); remove one")
        self.refuse_editing_with(source, "with 'sub_block_cache' (positions outside the "
                                         "active sub-block get no new proposal)")

    @classmethod
    def traits(cls, options: Mapping[str, Any]) -> PolicyTraits:
        chunked = (option_value(cls, options, "chunk_size") is not None
                   or option_value(cls, options, "chunk_reuse"))
        sub_blocks = option_value(cls, options, "sub_block_cache")
        return dataclasses.replace(super().traits(options), partial_blocks=(
            "options 'chunk_size' and 'chunk_reuse' compute part of a block in a forward; "
            "remove them") if chunked else None, attention_regimes=("block_causal", "full"),
            shifted_logits=True, shifted_partial_blocks=True, sub_block_rows=(
                "option 'sub_block_cache' computes only the active sub-block in some "
                "forwards; remove it") if sub_blocks else None)


@dataclasses.dataclass
class StandardState:
    """Per request: the chunk window and the sub-block cache."""

    window: ChunkWindow
    sub_blocks: SubBlockCache


class StandardPolicy(StrategyPolicy[StandardConfig, StandardState]):
    """Unmasks by one of ``STRATEGIES``, computing the whole block, a chunk of it, or its
    active sub-block."""

    name: ClassVar[str] = "standard"
    config_cls: ClassVar[type] = StandardConfig

    def new_state(self, config: StandardConfig) -> StandardState:
        return StandardState(ChunkWindow(self.block_size), SubBlockCache(self.block_size))

    def plan_step(self, request: DiffusionRequest[StandardConfig, StandardState],
                  start: BlockStart) -> BlockStepPlan:
        config, state = request.policy_config, request.policy_state
        if start is not None:
            state.window.start_block()
            state.sub_blocks.start_block()
        if config.sub_block_cache:
            return state.sub_blocks.plan(request.canvas, self.mask_token_id,
                                         config.sub_block_size)
        return state.window.plan(request.canvas, self.mask_token_id, config.chunk_size,
                                 config.chunk_reuse)

    def after_step(self, request: DiffusionRequest[StandardConfig, StandardState],
                   masked_before: torch.Tensor, computed: torch.Tensor,
                   num_decoded: int, block_done: bool) -> None:
        config, state = request.policy_config, request.policy_state
        if config.sub_block_cache:
            state.sub_blocks.after_step(computed)
        else:
            state.window.after_step(masked_before, computed, config.chunk_reuse,
                                    self.model.shifted_logits)
