"""What the logit stages read about each request of a step, beyond its logits: each row's
index in its request's output, the tokens seen so far (penalties) and the output so far
with its undecided positions (bad words). Built only where some request needs it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_diffusion.worker.bad_words import UNDECIDED
from vllm_diffusion.worker.proposal import has_penalties


def output_canvas(canvas: Any, state: Any, mask_token_id: int) -> list[int]:
    """A request's output so far for bad words: the emitted output, then its current
    block's output positions (``UNDECIDED`` where masked)."""
    emitted = len(state.prompt_token_ids) + len(state.output_token_ids)
    pending = canvas.tokens[emitted - canvas.start:].tolist()
    return list(state.output_token_ids) + [UNDECIDED if t == mask_token_id else t
                                           for t in pending]


def seen_by(canvas: Any, state: Any, mask_token_id: int) -> tuple[list[int], list[int]]:
    """A request's (prompt ids, output ids so far) for penalties: the committed output and
    its current block's filled output positions, whose tokens are not emitted yet."""
    prompt_len = len(state.prompt_token_ids)
    emitted = prompt_len + len(state.output_token_ids)
    pending = [t for p, t in enumerate(canvas.tokens.tolist(), start=canvas.start)
               if p >= emitted and t != mask_token_id]
    return list(state.prompt_token_ids), list(state.output_token_ids) + pending


@dataclasses.dataclass
class RowContext:
    words: list[list[list[int]]]  # per request, its bad words' token ids (may be empty)
    output_index: torch.Tensor | None  # [n] each row's index in its request's output
    seen_tokens: list[tuple[list[int], list[int]]] | None  # per request, for penalties
    output_canvas: list[list[int]] | None  # per request, for bad words

    @staticmethod
    def of(canvases: list[Any], states: list[Any], where: torch.Tensor,
           mask_token_id: int) -> RowContext:
        """canvases, states: each request's block canvas and vLLM state; where: [n, 2]
        each row's (request, block position)."""
        params = [s.sampling_params for s in states]
        words = [p.bad_words_token_ids or [] for p in params]
        output_index = seen_tokens = output_canvases = None
        if any(p.min_tokens for p in params) or any(words):
            # Each row's index in its request's output: block start + position - prompt.
            first_output = torch.tensor([c.start - len(s.prompt_token_ids)
                                         for c, s in zip(canvases, states)])
            output_index = first_output[where[:, 0]] + where[:, 1]
        if any(has_penalties(p) for p in params):
            seen_tokens = [seen_by(c, s, mask_token_id) for c, s in zip(canvases, states)]
        if any(words):
            output_canvases = [output_canvas(c, s, mask_token_id)
                               for c, s in zip(canvases, states)]
        return RowContext(words, output_index, seen_tokens, output_canvases)
