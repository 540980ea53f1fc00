"""The decoding-policy interface: what the runner and the model call, for any policy.

A policy is one class (plus its typed config) registered by name in ``POLICIES``. The
engine holds one instance; per request it keeps the policy's state and options. One
denoising step calls, in order (``begin_step`` first, with every scheduled request):

1. per request: ``commit_positions(request)`` when the step commits the block the request
   just completed (which of its positions are recomputed; default: all, the exact
   commit), then ``positions_to_compute(request, kv_lost)`` (the block positions computed
   this step; default: all) and ``block_key_end(request)`` (how far into the block keys
   reach; default: the whole block);
2. ``forward_hooks(step)`` once: an object whose methods the decoder stack calls at the
   layers it declares (``LayerHooks``) -- after a layer's keys/values are computed and
   before its attention (``before_attention``: may drop rows; their KV at that layer is
   still stored), after a layer's output (``after_output``: may drop rows), and inside
   attention (``select_keys``: which committed-prefix keys each request's block rows see,
   as kept-index lists, and which requests select them this step);
3. ``choose_commits(batch)`` once for all requests: which masked positions to unmask,
   then ``choose_edits(batch)``: which filled positions take a new token (LLaDA2.1
   editing; ``edits_tokens(request)`` says whether a request's tokens may still change);
4. ``after_step(request, ...)`` per request, and ``on_block_complete(request)`` when its
   block has no masked position left and ``block_ends(request, edited)`` agrees.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import torch

from vllm_diffusion.attention.sparse_prefix import PrefixSparsity
from vllm_diffusion.worker.request_state import DiffusionRequest


class PolicyConfig:
    """Base of the policies' typed option dataclasses (see ``options.option``)."""

    # Options a request may not override (set once for the engine).
    engine_only: ClassVar[tuple[str, ...]] = ()

    def validate_for_block(self, block_size: int, source: str) -> None:
        """Checks that need the block size; raise ``OptionError`` naming the option."""


@dataclasses.dataclass(frozen=True)
class LayerHooks:
    """The layers at which a step's hooks run (layer indices of the decoder stack)."""

    before_attention: tuple[int, ...] = ()
    after_output: tuple[int, ...] = ()
    select_keys: tuple[int, ...] = ()


@dataclasses.dataclass
class StepRequest:
    """One request of a step as the forward hooks see it."""

    request: DiffusionRequest | None  # None: prefill-only rows (no block this step)
    rows: range  # its query rows in the step
    block_rows: torch.Tensor | None  # [n] query rows of its computed block positions
    block_positions: torch.Tensor | None  # [n] block-relative positions of those rows

    def masked_rows(self, mask_token_id: int) -> torch.Tensor:
        """[m] step rows of its computed positions still masked (candidates), ascending."""
        masked = self.request.canvas.masked(mask_token_id)
        return self.block_rows[masked[self.block_positions]]


@dataclasses.dataclass
class ForwardStep:
    requests: list[StepRequest]
    num_rows: int
    device: torch.device


@dataclasses.dataclass
class RowSelection:
    """Rows that continue past a hook. ``keep``: [T] bool (host) over the rows that
    entered the layer; ``kv_lens``: request index -> its new key length from this layer's
    attention on (requests not named keep theirs)."""

    keep: torch.Tensor
    kv_lens: dict[int, int] | None = None


@dataclasses.dataclass
class LayerInput:
    """What a hook reads. ``rows``: [T'] step rows (original indices) entering the layer;
    ``query`` [T', H, D] and ``key`` [T', H_kv, D] after q/k-norm and RoPE (attention
    hooks) or ``hidden`` [T', hidden], the layer's output in the residual stream (output
    hooks); ``scale``: the attention scale."""

    layer: int
    rows: torch.Tensor
    query: torch.Tensor | None = None
    key: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    scale: float = 1.0

    def current_rows(self, step_rows: torch.Tensor) -> torch.Tensor:
        """Indices, among the rows entering this layer, of the step rows ``step_rows``
        (all of which must still be present)."""
        if not len(self.rows) or len(self.rows) == int(self.rows[-1]) + 1:
            return step_rows  # no row dropped yet (rows ascend)
        index = torch.full((int(self.rows[-1]) + 1,), -1, dtype=torch.long)
        index[self.rows] = torch.arange(len(self.rows))
        current = index[step_rows]
        if bool((current < 0).any()):
            raise RuntimeError("a hook asked for rows an earlier hook dropped")
        return current


class StepHooks:
    """A step's forward hooks; the defaults keep every row and every key."""

    layers: LayerHooks = LayerHooks()

    def before_attention(self, layer_input: LayerInput) -> RowSelection | None:
        return None

    def after_output(self, layer_input: LayerInput) -> RowSelection | None:
        return None

    def select_keys(self, layer_input: LayerInput) -> PrefixSparsity | None:
        """The layer's prefix sparsity (``attention.sparse_prefix``); None: dense."""
        return None


@dataclasses.dataclass
class EditBatch:
    """Every denoised block of a step, for token editing: confidence [R, B] float32 and
    proposals [R, B] int64 (host) of each computed position (-inf / any token elsewhere),
    tokens [R, B] the blocks before the step, filled [R, B] bool the computed positions
    filled at an earlier step of the block (never prompt positions)."""

    requests: list[DiffusionRequest]
    confidence: torch.Tensor
    proposals: torch.Tensor
    tokens: torch.Tensor
    filled: torch.Tensor


@dataclasses.dataclass
class CommitBatch:
    """Every denoised block of a step, stacked. confidence: [R, B] float32 (host) of each
    proposal, -inf where not proposed; masked: [R, B] bool, masked positions that were
    computed through every layer (the only ones that may be chosen)."""

    requests: list[DiffusionRequest]
    confidence: torch.Tensor
    masked: torch.Tensor


class DecodingPolicy(abc.ABC):
    name: ClassVar[str]
    config_cls: ClassVar[type[PolicyConfig]]
    # True if its forward hooks may drop rows inside the forward: the engine then runs
    # eagerly (vLLM compiles the forward once, for a row count fixed when it starts).
    drops_rows_in_forward: ClassVar[bool] = False

    def __init__(self, block_size: int, mask_token_id: int, engine_config: Any) -> None:
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.engine_config = engine_config  # the engine's defaults of config_cls

    def bind_model(self, hf_config: Any, prefix_caching: bool) -> None:
        """Check that the policy (with the engine's options) can run on this model and with
        this prefix-caching setting, and load what it needs for it; raise ``ValueError``
        naming the problem. Called at start-up and where the policy runs."""

    def begin_step(self, requests: list[DiffusionRequest]) -> None:
        """A step starts for these requests (all scheduled ones), before any is planned."""

    def new_state(self, config: Any) -> Any:
        """The policy's state for a new request with options ``config``."""
        return None

    def positions_to_compute(self, request: DiffusionRequest,
                             kv_lost: bool) -> torch.Tensor | None:
        """[B] bool: block positions to compute this step; None: the whole block.
        ``kv_lost``: the block's KV pages were freed (a resumed preemption)."""
        return None

    def block_key_end(self, request: DiffusionRequest) -> int | None:
        """How many of the block's positions (from its start) this step's keys reach
        (asked after ``positions_to_compute``); None: the whole block. Positions past it
        are neither computed nor attended to this step."""
        return None

    def commit_positions(self, request: DiffusionRequest) -> torch.Tensor | None:
        """[B] bool: positions of the just-completed block to recompute when committing
        it; None: all of them (the exact commit)."""
        return None

    def forward_hooks(self, step: ForwardStep) -> StepHooks | None:
        return None

    @abc.abstractmethod
    def choose_commits(self, batch: CommitBatch) -> torch.Tensor:
        """[R, B] bool: positions to unmask; a subset of ``batch.masked`` with at least
        one position per request that has one."""

    def edits_tokens(self, request: DiffusionRequest) -> bool:
        """Whether filled tokens of the request's block may still change (then they are
        emitted only when the block ends)."""
        return False

    def choose_edits(self, batch: EditBatch) -> torch.Tensor | None:
        """[R, B] bool: filled positions that take their proposal this step (a subset of
        ``batch.filled``); None: no edit."""
        return None

    def block_ends(self, request: DiffusionRequest, edited: bool) -> bool:
        """Asked when the request's block has no masked position left after a step
        (``edited``: the step changed a filled token): whether the block is complete."""
        return True

    def after_step(self, request: DiffusionRequest, masked_before: torch.Tensor,
                   computed: torch.Tensor, num_decoded: int) -> None:
        """masked_before: [B] bool before this step's commit; computed: [B] bool, the
        positions that went through every layer."""

    def on_block_complete(self, request: DiffusionRequest) -> None:
        """The request's block has no masked position left."""
