"""The decoding-policy interface: what the runner and the model call, for any policy.

A policy is one module (a class plus its typed config and per-request state) registered by
name in ``POLICIES``. The engine holds one instance; each request carries the policy's
options and state (``step.request.DiffusionRequest[Config, State]``). One denoising step
calls, in order (``begin_step`` first, with every scheduled request):

1. per request, the block lifecycle: ``start_block(request, resumed)`` when the request
   moved to a new block (``resumed=False``) or its block's KV was lost to a preemption
   (``resumed=True``: the same block, to be recomputed); then ``plan_step(request)``, the one
   planning call: which block positions to compute, how far keys reach, and (when the step
   commits the block the request just completed) which of its positions the commit
   recomputes (``step.plans.BlockStepPlan``);
2. ``forward_hooks(step)`` once: an object whose methods the model's layers call at the
   hook points it declares (``step.hooks``) -- after a layer's keys/values are computed and
   before its attention (``before_attention``: may drop rows; their KV at that layer is
   still stored), after a layer's output (``after_output``: may drop rows), and inside
   attention (``select_keys``: which committed-prefix keys each request's block rows see;
   ``preselect_keys`` when the selection reads nothing the forward computes: made before
   it, and the model runs whole; what the attention selected comes back through
   ``after_key_scoring``);
3. ``unmasking.choose_commits(batch)`` once for all requests: which masked positions to
   unmask (and ``unmasking.scheduled_idle(batch)``: which blocks' schedules leave this
   step empty by design), then ``unmasking.choose_edits(batch)``: which filled positions
   take a new token (LLaDA2.1 editing; ``unmasking.edits_tokens(request)`` says whether a
   request's tokens may still change); where the model's edits move tokens, ``unmasking.rewrite_block``
   per request instead (``unmasking.ranked_proposals()`` above 0);
4. ``after_step(request, ...)`` per request, and ``on_block_complete(request)`` when its
   block has no masked position left and ``unmasking.block_ends(request, edited, ...)``
   agrees.

The decision (step 3) is the policy's ``unmasking``, a ``BlockUnmasking`` the policy makes
when it is bound (``make_unmasking``); the rest is the policy's own.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

import torch

from vllm_diffusion.capabilities import ModelCapabilities, PolicyTraits
from vllm_diffusion.step.hooks import ForwardStep, StepHooks
from vllm_diffusion.step.plans import WHOLE_BLOCK, BlockStepPlan, CommitBatch, EditBatch
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


ConfigT = TypeVar("ConfigT", bound=PolicyConfig)
StateT = TypeVar("StateT")


class BlockUnmasking(abc.ABC, Generic[ConfigT, StateT]):
    """A policy's decision for the blocks a step computed: which masked positions it
    unmasks, which filled ones take a new token, when a block ends, or (where the model's
    edits move tokens) the rewriting of a block. The policy makes it when it is bound
    (``DecodingPolicy.make_unmasking``); per-position state it keeps lives in
    ``step.slots.SlotTable``s indexed by ``request.slot``."""

    def wants_entropy(self, requests: list[DiffusionRequest[ConfigT, StateT]]) -> bool:
        """Whether this step's commit choice for these requests needs each proposal's
        entropy (``CommitBatch.entropy``)."""
        return False

    @abc.abstractmethod
    def choose_commits(self, batch: CommitBatch) -> torch.Tensor:
        """[R, B] bool: positions to unmask; a subset of ``batch.masked`` with at least
        one position per request that has one, except where the request's commit
        schedule leaves this step empty (``scheduled_idle``)."""

    def scheduled_idle(self, batch: CommitBatch) -> list[bool]:
        """Per block of ``batch`` (asked with ``choose_commits``'s batch, before the
        step's commits): whether its commit schedule unmasks nothing this step by design
        (Dream's timesteps: a step whose quota truncates to 0). Such a step neither counts
        toward nor resets the engine's limit of steps without progress; the schedule
        itself must end the block within a bounded number of steps (its last step
        commits every available mask). Default: never."""
        return [False] * len(batch.requests)

    def edits_tokens(self, request: DiffusionRequest[ConfigT, StateT]) -> bool:
        """Whether filled tokens of the request's block may still change (then they are
        emitted only when the block ends)."""
        return False

    def choose_edits(self, batch: EditBatch) -> torch.Tensor | None:
        """[R, B] bool: filled positions that take their proposal this step (a subset of
        ``batch.filled``); None: no edit."""
        return None

    def ranked_proposals(self) -> int:
        """How many best tokens per position its block rewriting reads (``rewrite_block``;
        0: it does not rewrite blocks, the runner asks ``choose_commits`` /
        ``choose_edits`` / ``block_ends`` instead)."""
        return 0

    def rewrite_block(self, request: DiffusionRequest[ConfigT, StateT], old: torch.Tensor,
                      proposals: torch.Tensor, confidence: torch.Tensor,
                      ranked: torch.Tensor) -> Any:
        """One step of the request's block: old, proposals, confidence: [B]; ranked:
        [B, r] each position's best tokens in order. Returns a ``JointStep``."""
        raise NotImplementedError(f"{type(self).__name__} does not rewrite blocks")

    def block_ends(self, request: DiffusionRequest[ConfigT, StateT], edited: bool,
                   began_unmasked: bool) -> bool:
        """Asked when the request's block has no masked position left after a step
        (``edited``: the step changed a filled token; ``began_unmasked``: the step started
        with no masked position): whether the block is complete."""
        return True


class DecodingPolicy(abc.ABC, Generic[ConfigT, StateT]):
    """A decoding policy: binding (``traits``, ``bind``, ``bind_model``, ``new_state``),
    planning (``begin_step``, ``start_block``, ``plan_step``), hooks (``forward_hooks``),
    the decision (``unmasking``, made by ``make_unmasking``) and bookkeeping
    (``after_step``, ``on_block_complete``, ``chosen_chunk``, ``counters``)."""

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
    # The policy's decision (``make_unmasking``), made by ``bind``.
    unmasking: BlockUnmasking[ConfigT, StateT]

    # ---------------------------------------------------------------- binding
    @classmethod
    def traits(cls, options: Mapping[str, Any]) -> PolicyTraits:
        """What the policy does with ``options`` (given ones; absent ones take their
        defaults); ``capabilities.refusal`` compares it with the model's needs."""
        return PolicyTraits(partial_blocks=(
            "it computes part of a block in some forwards or does not unmask by the "
            "strategies; use the standard policy"))

    def bind(self, model: ModelCapabilities, hf_config: Any, prefix_caching: bool) -> None:
        """Bind the policy to the served model (at start-up and where the policy runs):
        records its capabilities, runs the policy's own checks (``bind_model``), then makes
        its decision (``unmasking = make_unmasking()``)."""
        self.model = model
        self.bind_model(hf_config, prefix_caching)
        self.unmasking = self.make_unmasking()

    def bind_model(self, hf_config: Any, prefix_caching: bool) -> None:
        """The policy's own checks of the model and the prefix-caching setting (with the
        engine's options), and what it loads for them; raise ``ValueError`` naming the
        problem. ``self.model`` is set."""

    @abc.abstractmethod
    def new_state(self, config: ConfigT) -> StateT:
        """The policy's state for a new request with options ``config``."""

    # --------------------------------------------------------------- planning
    def begin_step(self, requests: list[DiffusionRequest[ConfigT, StateT]]) -> None:
        """A step starts for these requests (all scheduled ones), before any is planned."""

    def start_block(self, request: DiffusionRequest[ConfigT, StateT], resumed: bool) -> None:
        """The request's current block (``request.canvas``) starts: it is new, or
        (``resumed``) it is the same block whose KV a preemption freed, so nothing of it
        is cached any more."""

    def plan_step(self, request: DiffusionRequest[ConfigT, StateT]) -> BlockStepPlan:
        """What this step computes for the request's block; default: all of it, and the
        exact commit."""
        return WHOLE_BLOCK

    # ------------------------------------------------------------------ hooks
    def forward_hooks(self, step: ForwardStep) -> StepHooks | None:
        """The step's hooks (``step.hooks``), or None where the policy has none."""
        return None

    # --------------------------------------------------------------- decision
    @abc.abstractmethod
    def make_unmasking(self) -> BlockUnmasking[ConfigT, StateT]:
        """The policy's decision (``unmasking``); ``self.model`` is set and checked."""

    # ------------------------------------------------------------ bookkeeping
    def after_step(self, request: DiffusionRequest[ConfigT, StateT],
                   masked_before: torch.Tensor, computed: torch.Tensor,
                   num_decoded: int) -> None:
        """masked_before: [B] bool before this step's commit; computed: [B] bool, the
        positions that went through every layer."""

    def on_block_complete(self, request: DiffusionRequest[ConfigT, StateT]) -> None:
        """The request's block has no masked position left."""

    def chosen_chunk(self) -> int | None:
        """The chunk size this step's requests compute, where the policy chooses one per
        step (exported as a metric); None otherwise."""
        return None

    def counters(self) -> dict[str, Any]:
        """The policy's own counters since start-up, reported with the engine's
        (``diffusion_stats``); none by default."""
        return {}
