"""The diffusion state of one request, kept by the runner from its first step to its end.

``DiffusionRequest`` holds everything the engine knows about a request beyond vLLM's own
bookkeeping: its policy options and policy state, the canvas of its current block (with
its denoising-step counters), and the decode step of every emitted token (its step map).
The runner creates it at the request's first step, keeps it across preemption (a resumed
request continues its block, and the policy is told that the block's KV was lost), and
drops it when the request finishes. It is generic in the policy's config and state types,
so a policy's methods name exactly what they read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

import torch


@dataclasses.dataclass
class BlockCanvas:
    """The current block of one request, as the runner denoises it."""

    start: int  # absolute position of the block's first token
    tokens: torch.Tensor  # [B] int64 (host), mask_token_id where undecided
    steps: int = 0  # denoising steps taken on this block
    post_steps: int = 0  # of them, steps that began with no masked position (editing)
    edits: int = 0  # filled positions given another token in this block (editing)
    first_step: int = 0  # the request's denoising steps before this block
    # [B] int64 (host): the request's denoising step (0-based) that last changed each
    # position (unmasked or edited it); -1 where it is fixed (prompt tail) or still masked
    decoded_at: torch.Tensor | None = None
    # [B, 2 + 2k] float64 (host): each position's logprob columns from the step that last
    # changed it (``worker/logprobs.py``); None unless the request asks for logprobs
    logprobs: torch.Tensor | None = None
    # LLaDA2.2's joint-decoding state of the block (``policies.joint_editing``), or None
    joint: Any = None
    # The block ended on a step that computed all of it and changed nothing (a stable
    # end of token editing): that forward's KV is the committed KV, its commit reuses it
    final_kv: bool = False

    def __post_init__(self) -> None:
        if self.decoded_at is None:
            self.decoded_at = torch.full_like(self.tokens, -1)

    def commit(self, positions: torch.Tensor, tokens: torch.Tensor,
               began_unmasked: bool = False, logprobs: torch.Tensor | None = None) -> None:
        """One step done: ``positions`` ([B] bool) were unmasked or edited; ``tokens``
        ([B] int64) is the block after it (the old tokens with the proposals at
        ``positions``); ``began_unmasked``: the step started with no masked position;
        ``logprobs``: [B, C] this step's logprob columns, kept where ``positions``."""
        self.tokens = tokens
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = torch.zeros(len(tokens), logprobs.shape[1], dtype=torch.float64)
            self.logprobs[positions] = logprobs[positions]
        self.post_steps += int(began_unmasked)
        self.decoded_at[positions] = self.first_step + self.steps
        self.steps += 1

    def rearrange(self, source: torch.Tensor, tokens: torch.Tensor) -> None:
        """Edits moved the block's tokens: position j now holds ``tokens[j]``, which was at
        ``source[j]`` ([B] int64; -1 for a new mask); per-position records move along."""
        moved = source >= 0
        origin = source.clamp(min=0)
        self.tokens = tokens
        self.decoded_at = torch.where(moved, self.decoded_at[origin],
                                      torch.full_like(self.decoded_at, -1))
        if self.logprobs is not None:
            self.logprobs = torch.where(moved[:, None], self.logprobs[origin],
                                        torch.zeros_like(self.logprobs))

    def masked(self, mask_token_id: int) -> torch.Tensor:
        """[B] bool: positions still undecided."""
        return self.tokens == mask_token_id


ConfigT = TypeVar("ConfigT")
StateT = TypeVar("StateT")


@dataclasses.dataclass(frozen=True)
class OutputBounds:
    """Where a request's output can end: its stop tokens (EOS unless ``ignore_eos``, and
    ``stop_token_ids``) and the absolute position one past its last allowed token (prompt
    length + ``max_tokens``). Tokens committed past either are decoded but never output."""

    stop_token_ids: frozenset[int] = frozenset()
    end: int | None = None


@dataclasses.dataclass(eq=False)  # one object per request: compared by identity
class DiffusionRequest(Generic[ConfigT, StateT]):
    req_id: str
    policy_config: ConfigT  # the request's policy options (engine defaults plus overrides)
    policy_state: StateT  # what the policy keeps for this request (None for stateless ones)
    wants_step_map: bool
    canvas: BlockCanvas | None = None
    # decode step of every emitted token (kept only when the request asked for it)
    step_map: list[int] = dataclasses.field(default_factory=list)
    # the request's structured-output matcher (vLLM's ``StructuredOutputGrammar``), its
    # state the emitted output (``worker/grammar.py``); None without structured output
    grammar: Any = None
    bounds: OutputBounds = OutputBounds()
    # consecutive denoising steps that wrote no token and ended no block (the runner ends
    # the request at the engine's limit)
    steps_without_progress: int = 0

    def block_for(self, block_start: int, fixed: list[int], block_size: int,
                  mask_token_id: int) -> BlockCanvas:
        """The canvas of the block starting at ``block_start`` (``fixed``: its known
        tokens), made anew when the request moved to that block."""
        canvas = self.canvas
        if canvas is not None and canvas.start == block_start:
            return canvas
        tokens = torch.full((block_size,), mask_token_id, dtype=torch.long)
        tokens[:len(fixed)] = torch.tensor(fixed, dtype=torch.long)
        first_step = canvas.first_step + canvas.steps if canvas is not None else 0
        self.canvas = BlockCanvas(block_start, tokens, first_step=first_step)
        return self.canvas
