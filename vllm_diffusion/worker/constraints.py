"""A request's own constraints on the tokens of its output, outside the logit stages:
``unsatisfiable_blocks`` (a flagged row at the leftmost undecided position ends the
request) and ``PositionRules`` (what the grammar walk checks a forced token against, since
forced text bypasses the logits). See docs/architecture.md, "Proposal stages".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_diffusion.options import listed
from vllm_diffusion.worker.bad_words import UNDECIDED, BadWords, barred_tokens
from vllm_diffusion.worker.sampling import ROW_NO_TOKEN, ROW_VALID


def constraints_in_use(params: Any, output_index: int) -> list[str]:
    """The request's parameters that bar tokens at ``output_index``, as errors name them."""
    used = []
    if params.allowed_token_ids is not None:
        used.append(f"allowed_token_ids={sorted(params.allowed_token_ids)[:16]}")
    if params.bad_words_token_ids:
        used.append(f"bad_words ({len(params.bad_words_token_ids)} tokenizations)")
    if params.min_tokens and output_index < params.min_tokens:
        used.append(f"min_tokens={params.min_tokens} (its stop tokens "
                    f"{listed(sorted(params.all_stop_token_ids or ()))} barred)")
    wanted = params.structured_outputs
    if wanted is not None and not wanted.all_constraints_none():
        used.append("structured_outputs (the grammar's allowed tokens)")
    return used + ["the mask token (never proposed)"]


def values_in_use(params: Any) -> list[str]:
    """The request's parameters that scale or shift logits (what can overflow them)."""
    used = [f"{name}={getattr(params, name)!r}" for name, neutral in
            (("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
             ("presence_penalty", 0.0), ("temperature", 1.0))
            if getattr(params, name) not in (None, neutral)]
    if params.logit_bias:
        used.append(f"logit_bias ({len(params.logit_bias)} entries)")
    return used


def unsatisfiable_message(params: Any, output_index: int, code: int) -> str:
    if code == ROW_NO_TOKEN:
        return (f"no token satisfies the request's constraints at output position "
                f"{output_index} ({', '.join(constraints_in_use(params, output_index))} "
                f"together bar every token)")
    return (f"the logits at output position {output_index} are not finite under the "
            f"request's sampling parameters ({', '.join(values_in_use(params)) or 'none'}): "
            f"a penalty or bias overflowed them, or the model produced NaN")


def unsatisfiable_blocks(invalid: torch.Tensor, masked: torch.Tensor, computed: torch.Tensor,
                         rewrites: bool) -> list[tuple[int, int, int]]:
    """invalid: [R, B] int8 (``sampling.ROW_*``), masked, computed: [R, B] bool. Returns
    (block, position, code) for each block that cannot go on: its leftmost undecided
    position was computed and flagged (or, with ``rewrites``, any computed position)."""
    if not bool(invalid.any()):  # the usual step (ROW_VALID is 0, as uncomputed places)
        return []
    flagged = (invalid != ROW_VALID) & computed
    if rewrites:
        needed = flagged
    else:
        first = masked.to(torch.int8).argmax(dim=1)  # [R]: leftmost undecided position
        needed = torch.zeros_like(flagged)
        needed[torch.arange(len(first)), first] = True
        needed &= flagged & masked
    found = []
    for block in torch.nonzero(needed.any(dim=1)).flatten().tolist():
        position = int(torch.nonzero(needed[block]).flatten()[0])
        found.append((block, position, int(invalid[block, position])))
    return found


@dataclasses.dataclass
class PositionRules:
    """What one request allows at the output positions of its block, for forced tokens."""

    allowed: frozenset[int] | None
    stops: frozenset[int]
    min_tokens: int
    words: BadWords
    # its output so far through the block's end (``UNDECIDED`` where not decided), with
    # what the walk placed this step; empty without bad words
    context: list[int]
    first_output: int  # the output index of the block's first position

    @staticmethod
    def of(params: Any, first_output: int, context: list[int] | None,
           block_size: int) -> PositionRules:
        """``context``: the request's output so far with its block (None: no bad words);
        copied and padded to the block's end, the walk's own copy for this step."""
        allowed = params.allowed_token_ids
        words = BadWords(params.bad_words_token_ids or [])
        context = list(context or []) if words else []
        if words:
            context += [UNDECIDED] * (first_output + block_size - len(context))
        return PositionRules(None if allowed is None else frozenset(allowed),
                             frozenset(params.all_stop_token_ids or ()),
                             params.min_tokens or 0, words, context, first_output)

    def admits(self, position: int, token: int) -> bool:
        """Whether ``token`` may stand at block position ``position``, with the tokens
        ``place``d before it in the same walk as context."""
        if self.allowed is not None and token not in self.allowed:
            return False
        index = self.first_output + position
        if index < self.min_tokens and token in self.stops:
            return False
        return not self.words or token not in barred_tokens(self.context, index, self.words)

    def place(self, position: int, token: int) -> None:
        """The walk took ``token`` at block position ``position`` (context for the next)."""
        if self.words:
            self.context[self.first_output + position] = token


def position_rules(canvases: list[Any], states: list[Any],
                   output_canvases: list[list[int]] | None, wanted: list[bool]
                   ) -> list[PositionRules | None]:
    """Per block, its request's ``PositionRules`` where ``wanted`` (output_canvases: each
    request's output so far, where some request has bad words)."""
    return [PositionRules.of(state.sampling_params,
                             canvas.start - len(state.prompt_token_ids),
                             None if output_canvases is None else output_canvases[i],
                             len(canvas.tokens))
            if wanted[i] else None
            for i, (canvas, state) in enumerate(zip(canvases, states))]
