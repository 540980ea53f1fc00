"""The decoding-policy interface (``DecodingPolicy``) and the base of its typed options
(``PolicyConfig``). The engine holds one policy, bound to the served model at start-up
(``bind``); each request carries its options and the state ``new_state`` made
(``step.request.DiffusionRequest[Config, State]``). One denoising step calls, in order:

1. ``begin_step(requests)`` with every scheduled request;
2. ``plan_step(request, start)`` per request whose block the step computes;
3. ``forward_hooks(step)`` once: the hooks the model's layers call (``step.hooks``);
4. ``decide(blocks)`` once for every denoised block (``step.plans.StepDecision``);
5. ``after_step(request, ...)`` per block, once its canvas took the step.

``counters()`` reports the policy's own counters. What each call may do:
docs/extending.md, "A new policy".
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, Literal, TypeVar

import torch

from vllm_diffusion.capabilities import ModelCapabilities, PolicyTraits
from vllm_diffusion.step.hooks import ForwardStep, StepHooks
from vllm_diffusion.step.plans import WHOLE_BLOCK, BlockStepPlan, StepBlocks, StepDecision
from vllm_diffusion.step.request import DiffusionRequest


class PolicyConfig:
    """Base of the policies' typed option dataclasses (see ``options.option``)."""

    # Options a request may not override (set once for the engine).
    engine_only: ClassVar[tuple[str, ...]] = ()
    # Options that mean something only where the model's edits move tokens within a block
    # (refused for other models, ``capabilities.refusal``).
    token_moving_options: ClassVar[tuple[str, ...]] = ()

    def validate_for_block(self, block_size: int, source: str) -> None:
        """Checks that need the block size; raise ``OptionError`` naming the option."""

    @classmethod
    def traits(cls, options: Mapping[str, Any]) -> PolicyTraits:
        """What the policy does with ``options`` (absent ones take their defaults);
        ``capabilities.refusal`` compares it with the model's needs."""
        return PolicyTraits(partial_blocks=(
            "it computes part of a block in some forwards or does not unmask by the "
            "strategies; use the standard policy"))

    @property
    def needs_entropy(self) -> bool:
        """Whether the decision for these options reads ``StepBlocks.entropy``."""
        return False


ConfigT = TypeVar("ConfigT", bound=PolicyConfig)
StateT = TypeVar("StateT")


# A block's start as a step plans it: a new block, the same block whose KV a preemption
# freed (nothing of it is cached any more), or neither (the block goes on).
BlockStart = Literal["new", "resumed"] | None


class DecodingPolicy(abc.ABC, Generic[ConfigT, StateT]):
    """A decoding policy (the module doc gives the order of the calls)."""

    name: ClassVar[str]
    config_cls: ClassVar[type[PolicyConfig]]
    # A sampled proposal's confidence: "sampled_token" (its probability; SDAR's
    # definition) or "max_probability" (the distribution's largest probability, as the
    # ES-dLLM and Ada-DLM papers define it). Greedy proposals agree under both.
    confidence_rule: ClassVar[str] = "sampled_token"

    def __init__(self, block_size: int, mask_token_id: int, engine_config: ConfigT) -> None:
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.engine_config = engine_config  # the engine's defaults of config_cls

    # The served model, once bound (``bind``).
    model: ModelCapabilities = ModelCapabilities(family="no model yet")
    # How many best tokens per position its decision reads (``StepBlocks.ranked``; set by
    # ``bind``: above 0 only where the model's edits move tokens).
    proposal_ranks: int = 0

    def bind(self, model: ModelCapabilities, hf_config: Any, prefix_caching: bool) -> None:
        """Bind to the served model's capabilities at start-up; a policy's own checks extend
        it, raising ``ValueError`` naming the problem."""
        self.model = model

    @abc.abstractmethod
    def new_state(self, config: ConfigT) -> StateT:
        """The policy's state for a new request with options ``config``."""

    def begin_step(self, requests: list[DiffusionRequest[ConfigT, StateT]]) -> None:
        """A step starts for these requests (all scheduled ones), before any is planned."""

    def plan_step(self, request: DiffusionRequest[ConfigT, StateT],
                  start: BlockStart) -> BlockStepPlan:
        """What this step computes of the request's block (``request.canvas``); default:
        all of it, and the exact commit."""
        return WHOLE_BLOCK

    def forward_hooks(self, step: ForwardStep) -> StepHooks | None:
        """The step's hooks (``step.hooks``), or None where the policy has none."""
        return None

    @abc.abstractmethod
    def decide(self, blocks: StepBlocks) -> StepDecision:
        """What changes in the step's denoised blocks (``StepDecision``)."""

    def after_step(self, request: DiffusionRequest[ConfigT, StateT],
                   masked_before: torch.Tensor, computed: torch.Tensor,
                   num_decoded: int, block_done: bool) -> None:
        """The request's block took the step: masked_before [B] bool before it, computed
        [B] bool the positions that went through every layer, ``block_done``: it ended."""

    def counters(self) -> dict[str, Any]:
        """The policy's own counters since start-up (``diffusion_stats``); none by default."""
        return {}
