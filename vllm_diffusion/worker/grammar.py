"""Structured output (JSON schema, regex, choice, grammar) in block decoding: a matcher per
request, compiled with vLLM's backends, masks the leftmost undecided position F, and the
walk (``walk``) takes grammar-valid candidates from F rightwards; only the run contiguous
from F is committed. See docs/architecture.md, "Structured output".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_diffusion.config import ROLLBACK_BACKENDS
from vllm_diffusion.step.failures import UncompilableGrammar


class GrammarCompiler:
    """Compiles requests' grammars in the worker with vLLM's backend for them."""

    def __init__(self, vllm_config: Any, stats: Any) -> None:
        """stats: the runner's counters (``grammar_fills``, ``grammar_accepts``)."""
        self.vllm_config = vllm_config
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.backends: dict[str, Any] = {}
        self.tokenizer: Any = None
        self.words = (self.vocab_size + 31) // 32
        self.stats = stats

    def _backend(self, name: str) -> Any:
        if name not in self.backends:
            from vllm.tokenizers import cached_tokenizer_from_config

            self.tokenizer = tokenizer = cached_tokenizer_from_config(
                model_config=self.vllm_config.model_config)
            if name == "xgrammar":
                from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend
                backend_cls = XgrammarBackend
            elif name == "guidance":
                from vllm.v1.structured_output.backend_guidance import GuidanceBackend
                backend_cls = GuidanceBackend
            else:
                raise ValueError(f"structured output backend {name!r} cannot roll back; "
                                 f"block decoding needs one of {ROLLBACK_BACKENDS}")
            self.backends[name] = backend_cls(self.vllm_config, tokenizer=tokenizer,
                                              vocab_size=self.vocab_size)
        return self.backends[name]

    def compile(self, params: Any) -> Any | None:
        """The request's matcher (vLLM's ``StructuredOutputGrammar``) or None; raises
        ``UncompilableGrammar`` (HTTP 400) where the backend cannot compile it."""
        from vllm.v1.structured_output.request import StructuredOutputRequest

        request = StructuredOutputRequest.from_sampling_params(params)
        if request is None:
            return None
        kind, spec = request.structured_output_key
        backend = self._backend(params.structured_outputs._backend)
        try:
            return backend.compile_grammar(kind, spec, stop_token_ids=params.all_stop_token_ids)
        except Exception as err:
            raise UncompilableGrammar(kind, err) from err

    def jump_forward(self, grammar: Any) -> list[int]:
        """The tokens of the text the grammar forces next (xgrammar's jump-forward
        string), but the last: the text after it may merge with its end into a token the
        model would rather use (``"`` then ``:`` against ``":``). Empty where none."""
        matcher = getattr(grammar, "matcher", None)
        find = getattr(matcher, "find_jump_forward_string", None)
        text = find() if find is not None else ""
        if not text:
            return []
        # Forced text is text: a special token's literal inside it (``<|im_end|>``) is
        # the characters, as the grammar means them, not the special token.
        return self.tokenizer.encode(text, add_special_tokens=False,
                                     split_special_tokens=True)[:-1]

    def allowed(self, grammar: Any) -> torch.Tensor:
        """[W] int32 bitmask of the tokens allowed next (bit t % 32 of word t // 32)."""
        bitmask = torch.full((1, self.words), -1, dtype=torch.int32)
        grammar.fill_bitmask(bitmask, 0)
        self.stats.grammar_fills += 1
        return bitmask[0]


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[W] int32 bitmask -> [vocab_size] bool."""
    bits = (bitmask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].bool()


def is_allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[token // 32]) >> (token % 32)) & 1)


def forced_token(bitmask: torch.Tensor, vocab_size: int) -> int | None:
    """The only allowed token, or None when there are several (or none)."""
    allowed = torch.nonzero(unpack(bitmask, vocab_size)).flatten()
    return int(allowed[0]) if len(allowed) == 1 else None


@dataclasses.dataclass
class Walk:
    """A request's walk over its block: candidates from F rightwards."""

    tokens: list[int]  # candidate of each walked position, F first
    confidence: list[float]


def walk(compiler: GrammarCompiler, grammar: Any, req_id: str, proposals: list[int],
         confidence: list[float], usable: list[bool], first: int,
         first_bitmask: torch.Tensor | None = None, rules: Any = None) -> Walk:
    """The walk from block position ``first`` (F). usable: positions computed with a valid
    proposal; first_bitmask: the bitmask at F when filled this step; rules: the request's
    ``constraints.PositionRules`` (None: none). Leaves the matcher as it was."""
    result = Walk([], [])
    vocab = compiler.vocab_size
    position = first

    def take(tokens: list[int], forced: bool) -> int:
        """Accept ``tokens`` from ``position`` on while each is usable there, admitted
        by the rules and accepted by the matcher; returns how many."""
        nonlocal position
        taken = 0
        for token in tokens:
            if (position >= len(proposals) or not usable[position]
                    or grammar.is_terminated()
                    or (rules is not None and not rules.admits(position, token))
                    or not grammar.accept_tokens(req_id, [token])):
                break
            compiler.stats.grammar_accepts += 1
            result.tokens.append(token)
            result.confidence.append(1.0 if forced else confidence[position])
            if rules is not None:
                rules.place(position, token)
            position += 1
            taken += 1
        return taken

    while position < len(proposals) and usable[position] and not grammar.is_terminated():
        # The forced text from here; where there is none, or its first token is refused,
        # one position by the bitmask.
        forced = compiler.jump_forward(grammar)
        taken = take(forced, True) if forced else 0
        if forced and taken == len(forced):
            continue
        if taken:
            break  # the rest of the forced text is the model's to propose next step
        bitmask = (first_bitmask if position == first and first_bitmask is not None
                   else compiler.allowed(grammar))
        only = forced_token(bitmask, vocab)
        if only is not None:
            taken = take([only], True)
        elif is_allowed(bitmask, proposals[position]):
            taken = take([proposals[position]], False)
        if not taken:
            break
    if result.tokens:
        grammar.rollback(len(result.tokens))
    return result


class GrammarStep:
    """The grammar's part of one denoising step over its R blocks."""

    def __init__(self, compiler: GrammarCompiler, grammars: list[Any], req_ids: list[str],
                 masked: torch.Tensor) -> None:
        """grammars: per block, its request's matcher or None; masked: [R, B] bool. A
        complete grammar constrains nothing more (as in vLLM's autoregressive path)."""
        self.compiler = compiler
        self.grammars = [None if g is not None and g.is_terminated() else g
                         for g in grammars]
        self.req_ids = req_ids
        self.first = [int(torch.nonzero(m).flatten()[0]) if g is not None and bool(m.any())
                      else -1 for g, m in zip(self.grammars, masked)]
        self.walks: list[Walk | None] = [None] * len(grammars)
        self.first_bitmasks: list[torch.Tensor | None] = [None] * len(grammars)  # [W] each
        # block -> the exception its matcher raised; that block is left alone afterwards
        self.errors: dict[int, Exception] = {}

    def take_errors(self, doing: str) -> dict[int, tuple[str, Exception]]:
        """The blocks whose matcher raised since the last call, with ``doing``."""
        errors = {block: (doing, err) for block, err in self.errors.items()}
        self.errors.clear()
        return errors

    def _drop(self, block: int, err: Exception) -> None:
        """A matcher raised: the block's request fails alone; its grammar is left alone."""
        self.errors[block] = err
        self.grammars[block] = None
        self.first[block] = -1

    @property
    def active(self) -> bool:
        return any(f >= 0 for f in self.first)

    def first_row_masks(self, where: torch.Tensor, counts: list[int]
                        ) -> list[tuple[int, torch.Tensor] | None]:
        """Per block, (F's row within the block's rows, [V] bool tokens allowed at F) for
        the ``grammar`` logit stage, or None (no grammar, or F not computed this step).
        where: [n, 2] each row's (block, position), blocks' rows consecutive."""
        masks: list[tuple[int, torch.Tensor] | None] = [None] * len(self.grammars)
        start = 0
        for block, (grammar, first, count) in enumerate(zip(self.grammars, self.first,
                                                            counts)):
            rows = where[start:start + count, 1]
            start += count
            hit = torch.nonzero(rows == first).flatten() if first >= 0 else []
            if grammar is None or len(hit) == 0:
                continue
            try:
                bitmask = self.compiler.allowed(grammar)
            except Exception as err:  # noqa: BLE001 - isolated to this request
                self._drop(block, err)
                continue
            self.first_bitmasks[block] = bitmask  # the walk starts from the same state
            masks[block] = (int(hit[0]), unpack(bitmask, self.compiler.vocab_size))
        return masks

    def constrain(self, proposals: torch.Tensor, confidence: torch.Tensor,
                  available: torch.Tensor, usable: torch.Tensor,
                  rules: list[Any] | None = None) -> None:
        """Walk every grammar block (in place, [R, B] each): its walked positions get their
        candidates and confidences and are the only ones available to commit. rules: per
        block, its request's ``constraints.PositionRules`` or None."""
        for block, (grammar, first) in enumerate(zip(self.grammars, self.first)):
            if grammar is None:
                continue
            available[block] = False
            if first < 0:
                continue
            try:
                found = walk(self.compiler, grammar, self.req_ids[block],
                             proposals[block].tolist(), confidence[block].tolist(),
                             usable[block].tolist(), first, self.first_bitmasks[block],
                             None if rules is None else rules[block])
            except Exception as err:  # noqa: BLE001 - isolated to this request
                self._drop(block, err)
                continue
            self.walks[block] = found
            span = slice(first, first + len(found.tokens))
            proposals[block, span] = torch.tensor(found.tokens, dtype=proposals.dtype)
            confidence[block, span] = torch.tensor(found.confidence, dtype=confidence.dtype)
            available[block, span] = True

    def include_first(self, commits: torch.Tensor) -> None:
        """F is committed in every grammar block whose walk took it ([R, B] in place)."""
        for block, found in enumerate(self.walks):
            if found is not None and found.tokens:
                commits[block, self.first[block]] = True

    def restrict(self, commits: torch.Tensor) -> None:
        """Keep each grammar block's commits to the run contiguous from F ([R, B] in
        place; after ``include_first`` and the bad-words undo)."""
        for block, found in enumerate(self.walks):
            if self.grammars[block] is None:
                continue
            chosen = commits[block].clone()
            commits[block] = False
            if not found or not found.tokens:
                continue
            first = end = self.first[block]
            while end < first + len(found.tokens) and bool(chosen[end]):
                end += 1
            commits[block, first:end] = True


def advance(compiler: GrammarCompiler, grammar: Any, req_id: str, tokens: list[int]) -> None:
    """The request's emitted tokens advance its matcher; a token it rejects (which the
    walk rules out) fails the request."""
    if tokens and not grammar.accept_tokens(req_id, tokens):
        raise RuntimeError(f"the grammar rejected emitted tokens {tokens}")
    compiler.stats.grammar_accepts += len(tokens)
