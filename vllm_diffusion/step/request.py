"""The diffusion state of one request (``DiffusionRequest``), kept by the runner with its slot
from its first step to its end, across preemption: its policy options and state, its
current block's canvas and the decode step of every emitted token. Generic in the policy's
config and state types.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

import torch

from vllm_diffusion.step.slots import BlockSlots


class BlockCanvas:
    """The current block of one request, as the runner denoises it: row ``slot`` of
    ``slots`` (its tokens and decode steps, written in place) and the block's counters.
    ``BlockCanvas(start, tokens)`` makes one on slots of its own (outside a runner)."""

    def __init__(self, start: int, tokens: torch.Tensor | None = None, *,
                 slots: BlockSlots | None = None, slot: int | None = None,
                 first_step: int = 0) -> None:
        if slots is None:
            slots = BlockSlots(len(tokens))
            slot = slots.acquire()
        self.slots, self.slot = slots, slot
        self.start = start  # absolute position of the block's first token
        if tokens is not None:
            self.tokens.copy_(tokens)
        self.decoded_at.fill_(-1)
        self.steps = 0  # denoising steps taken on this block
        self.post_steps = 0  # of them, steps that began with no masked position (editing)
        self.edits = 0  # filled positions given another token in this block (editing)
        self.first_step = first_step  # the request's denoising steps before this block
        # [B, 2 + 2k] float64 (host): each position's logprob columns from the step that last
        # changed it (``worker/logprobs.py``); None unless the request asks for them
        self.logprobs: torch.Tensor | None = None
        # the state a policy's block rewriting keeps for the block (where the model's edits
        # move tokens: ``policies/parts/strategy_unmasking.py``), or None
        self.rewrite_state: Any = None
        # ended on a step that computed all of it and changed nothing (stable token editing):
        # that forward's KV is the committed KV, which the commit reuses
        self.final_kv = False

    @property
    def tokens(self) -> torch.Tensor:
        """[B] int64 (host), mask_token_id where undecided: the slot's row (a view)."""
        return self.slots.tokens[self.slot]

    @property
    def decoded_at(self) -> torch.Tensor:
        """[B] int64 (host): the request's denoising step (0-based) that last changed each
        position (unmasked or edited it); -1 where it is fixed (prompt tail) or still
        masked. The slot's row (a view)."""
        return self.slots.decoded_at[self.slot]

    def __repr__(self) -> str:
        return (f"BlockCanvas(start={self.start}, slot={self.slot}, steps={self.steps}, "
                f"tokens={self.tokens.tolist()})")

    def commit(self, positions: torch.Tensor, tokens: torch.Tensor,
               began_unmasked: bool = False, logprobs: torch.Tensor | None = None) -> None:
        """One step done: ``positions`` ([B] bool) were unmasked or edited; ``tokens``
        ([B] int64) is the block after it (the old tokens with the proposals at
        ``positions``), copied into the slot's row; ``began_unmasked``: the step started
        with no masked position; ``logprobs``: [B, C] this step's logprob columns, kept
        where ``positions``."""
        self.tokens.copy_(tokens)
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
        decoded_at = self.decoded_at
        decoded_at.copy_(torch.where(moved, decoded_at[origin], -1))
        self.tokens.copy_(tokens)
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
    # its structured-output matcher (vLLM's ``StructuredOutputGrammar``, in the state of the
    # emitted output: ``worker/grammar.py``); None without structured output
    grammar: Any = None
    # no policy may skip or evict its rows (set with a grammar, whose walk reads every
    # position right of the leftmost undecided one)
    keep_all_rows: bool = False
    bounds: OutputBounds = OutputBounds()
    steps_without_progress: int = 0  # consecutive steps with no token written, no block ended
    # the runner's block slots and the request's row in them (its canvases, the policies'
    # slot tables); None apart from a runner (its canvases on slots of their own)
    block_slots: BlockSlots | None = None
    slot: int | None = None

    def block_for(self, block_start: int, fixed: list[int], block_size: int,
                  mask_token_id: int) -> BlockCanvas:
        """The canvas of the block starting at ``block_start`` (``fixed``: its known
        tokens), made anew (on the request's slot) when the request moved to that block."""
        canvas = self.canvas
        if canvas is not None and canvas.start == block_start:
            return canvas
        tokens = torch.tensor([*fixed, *[mask_token_id] * (block_size - len(fixed))],
                              dtype=torch.long)
        first_step = canvas.first_step + canvas.steps if canvas is not None else 0
        self.canvas = BlockCanvas(block_start, tokens, slots=self.block_slots, slot=self.slot,
                                  first_step=first_step)
        return self.canvas
