"""Standard block-diffusion decoding: every step computes the whole block, or the chunk
window of chunked decoding (``chunk_window.py``), and unmasks by one of the strategies of
``unmasking.py``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from vllm_diffusion.capabilities import PolicyTraits
from vllm_diffusion.policies.chunk_window import ChunkConfig, ChunkWindow
from vllm_diffusion.policies.strategy_unmasking import StrategyPolicy
from vllm_diffusion.step.plans import BlockStepPlan
from vllm_diffusion.step.request import DiffusionRequest


@dataclasses.dataclass(frozen=True)
class StandardConfig(ChunkConfig):
    """The strategy and chunk-window options (see ``chunk_window.ChunkConfig``)."""


class StandardPolicy(StrategyPolicy[StandardConfig, ChunkWindow]):
    """Unmasks by one of ``STRATEGIES``, computing the whole block or a chunk of it."""

    name: ClassVar[str] = "standard"
    config_cls: ClassVar[type] = StandardConfig

    @classmethod
    def traits(cls, options: Mapping[str, Any]) -> PolicyTraits:
        chunked = options.get("chunk_size") is not None or options.get("chunk_reuse", False)
        return dataclasses.replace(super().traits(options), partial_blocks=(
            "options 'chunk_size' and 'chunk_reuse' compute part of a block in a forward; "
            "remove them") if chunked else None, attention_regimes=("block_causal", "full"),
            shifted_logits=True)

    def new_state(self, config: StandardConfig) -> ChunkWindow:
        return ChunkWindow(self.block_size)

    def start_block(self, request: DiffusionRequest[StandardConfig, ChunkWindow],
                    resumed: bool) -> None:
        request.policy_state.start_block()

    def plan_step(self, request: DiffusionRequest[StandardConfig, ChunkWindow]
                  ) -> BlockStepPlan:
        config = request.policy_config
        return request.policy_state.plan(request.canvas, self.mask_token_id,
                                         config.chunk_size, config.chunk_reuse)

    def after_step(self, request: DiffusionRequest[StandardConfig, ChunkWindow],
                   masked_before: torch.Tensor, computed: torch.Tensor,
                   num_decoded: int) -> None:
        request.policy_state.after_step(masked_before, computed,
                                        request.policy_config.chunk_reuse)
