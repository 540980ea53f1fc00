"""The proposal pipeline: from the logits of a step's block rows to each row's proposed
token and its confidence, then the policy's commit choice. The stages run in vLLM's
sampler order, each a named slot (``STAGES``); a slot without a stage has its parameters
refused at admission (``SLOT_PARAMETERS``). See docs/architecture.md, "Proposal stages".
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import torch

from vllm_diffusion.worker.bad_words import BadWords, barred_tokens
from vllm_diffusion.worker.logprobs import (LOGPROBS_MODES, columns, distribution_values,
                                            processed_logits, top_count, use_given_tokens,
                                            wants_logprobs)
from vllm_diffusion.worker.sampling import (ROW_FAILED, ROW_NO_TOKEN, ROW_NOT_FINITE,
                                            ROW_VALID, draw_for_requests)


@dataclasses.dataclass
class ProposalBatch:
    """The block rows of a step's requests, on their way through the stages."""

    logits: torch.Tensor  # [n, V] float32; request i owns the next counts[i] rows
    counts: list[int]
    params: list  # each request's SamplingParams
    generators: list  # each request's torch.Generator (None: unseeded)
    # [n] int64 (host): each row's index in its request's output; None where not needed
    output_index: torch.Tensor | None = None
    # per request, (prompt token ids, output token ids so far: the committed output and
    # the current block's filled output positions); None where no request has penalties
    seen_tokens: list[tuple[list[int], list[int]]] | None = None
    # per request, its output so far with the current block (``bad_words.UNDECIDED`` at
    # undecided positions); None where no request has bad words
    output_canvas: list[list[int]] | None = None
    # per request, (its leftmost undecided position's row within its rows, [V] bool the
    # tokens its grammar allows there), or None; None where no request has a grammar
    grammar_rows: list | None = None
    spans: list[slice] = dataclasses.field(init=False)  # each request's rows

    def __post_init__(self) -> None:
        starts = [0, *itertools.accumulate(self.counts)]
        self.spans = [slice(start, stop) for start, stop in zip(starts, starts[1:])]


def has_penalties(params) -> bool:
    """Whether a request's sampling parameters ask for any penalty."""
    return (abs(getattr(params, "presence_penalty", 0.0) or 0.0) > 1e-5
            or abs(getattr(params, "frequency_penalty", 0.0) or 0.0) > 1e-5
            or abs((getattr(params, "repetition_penalty", 1.0) or 1.0) - 1.0) > 1e-5)


LogitStage = Callable[[ProposalBatch], None]


def allowed_token_ids(batch: ProposalBatch) -> None:
    """A request's ``allowed_token_ids``: every computed position of its block may propose
    only those tokens (admission refuses a list holding only the mask token)."""
    for rows, params in zip(batch.spans, batch.params):
        allowed = getattr(params, "allowed_token_ids", None)
        if allowed is None or rows.start == rows.stop:
            continue
        banned = torch.ones(batch.logits.shape[-1], dtype=torch.bool,
                            device=batch.logits.device)
        banned[torch.tensor(allowed, device=batch.logits.device)] = False
        batch.logits[rows] = batch.logits[rows].masked_fill(banned, float("-inf"))


def bad_words(batch: ProposalBatch) -> None:
    """A request's ``bad_words_token_ids``: at every computed position, the tokens that
    would complete a word with the decided tokens around it are barred."""
    for index, (rows, params) in enumerate(zip(batch.spans, batch.params)):
        words = getattr(params, "bad_words_token_ids", None)
        if not words or rows.start == rows.stop:
            continue
        context, words = batch.output_canvas[index], BadWords(words)  # indexed once
        for row in range(rows.start, rows.stop):
            barred = barred_tokens(context, int(batch.output_index[row]), words)
            if barred:
                batch.logits[row, torch.tensor(sorted(barred), device=batch.logits.device)] = (
                    float("-inf"))


def grammar(batch: ProposalBatch) -> None:
    """A request's grammar's mask at its leftmost undecided position (``grammar.py``)."""
    for rows, entry in zip(batch.spans, batch.grammar_rows or ()):
        if entry is not None:
            row, allowed = entry
            batch.logits[rows.start + row] = batch.logits[rows.start + row].masked_fill(
                ~allowed.to(batch.logits.device), float("-inf"))


def min_tokens(batch: ProposalBatch) -> None:
    """A request's ``min_tokens``: its stop tokens (``all_stop_token_ids``) are barred at
    every position whose index in the output is below the minimum."""
    for rows, params in zip(batch.spans, batch.params):
        minimum = getattr(params, "min_tokens", 0) or 0
        stops = sorted(getattr(params, "all_stop_token_ids", None) or ())
        if not minimum or not stops or rows.start == rows.stop:
            continue
        early = torch.nonzero(batch.output_index[rows] < minimum).flatten() + rows.start
        if len(early):
            device = batch.logits.device
            batch.logits[early.to(device)[:, None], torch.tensor(stops, device=device)] = (
                float("-inf"))


def penalties(batch: ProposalBatch) -> None:
    """vLLM's penalties at every computed position of a request's block, over its prompt
    (repetition only) and its output so far (committed tokens plus the block's filled
    output positions). Unlike vLLM's [rows, V] counts, a request's history is counted
    once ([V]) for all its rows, which keeps the logits budget."""
    for index, (rows, params) in enumerate(zip(batch.spans, batch.params)):
        if rows.start == rows.stop or not has_penalties(params):
            continue
        prompt_ids, output_ids = batch.seen_tokens[index]
        logits = batch.logits[rows]
        vocab, device = logits.shape[-1], logits.device
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long),
                                minlength=vocab)[:vocab].to(device, logits.dtype)
        seen = counts > 0
        repetition = params.repetition_penalty or 1.0
        if abs(repetition - 1.0) > 1e-5:
            in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            in_prompt[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
            repeated = in_prompt | seen
            logits = torch.where(repeated & (logits > 0), logits / repetition,
                                 torch.where(repeated, logits * repetition, logits))
        logits = logits - (params.frequency_penalty or 0.0) * counts
        logits = logits - (params.presence_penalty or 0.0) * seen.to(logits.dtype)
        batch.logits[rows] = logits


def logit_bias(batch: ProposalBatch) -> None:
    """A request's ``logit_bias`` added to its rows' raw logits (before temperature, as vLLM)."""
    for rows, params in zip(batch.spans, batch.params):
        bias = getattr(params, "logit_bias", None)
        if not bias or rows.start == rows.stop:
            continue
        device = batch.logits.device
        ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        values = torch.tensor(list(bias.values()), dtype=batch.logits.dtype, device=device)
        batch.logits[rows, ids] += values

# The sampling parameters each slot honours, and which admission refuses while it is empty.
SLOT_PARAMETERS: dict[str, tuple[str, ...]] = {
    "allowed_token_ids": ("allowed_token_ids",),
    "bad_words": ("bad_words",),
    "min_tokens": ("min_tokens",),
    "logit_bias": ("logit_bias",),
    "penalties": ("presence_penalty", "frequency_penalty", "repetition_penalty"),
    "grammar": ("structured_outputs",),
}
# The logit slots, in SLOT_PARAMETERS' order; None: no stage yet.
LOGIT_STAGES: dict[str, LogitStage | None] = {
    "allowed_token_ids": allowed_token_ids, "bad_words": bad_words, "min_tokens": min_tokens,
    "logit_bias": logit_bias, "penalties": penalties, "grammar": grammar}
STAGES = (*LOGIT_STAGES, "mask_token", "temperature", "top_k_top_p", "draw", "commit_choice")


CONFIDENCE_RULES = ("sampled_token", "max_probability")


def invalid_rows(logits: torch.Tensor) -> torch.Tensor:
    """[n, V] -> [n] int8: each row's ``ROW_*`` code, from one reduction: a row's maximum
    is -inf when every token is barred, NaN or +inf when a logit is NaN or overflowed."""
    row_max = logits.amax(dim=-1)
    return torch.where(row_max == float("-inf"), ROW_NO_TOKEN,
                       torch.where(torch.isfinite(row_max), ROW_VALID,
                                   ROW_NOT_FINITE)).to(torch.int8)

# fp32 [rows, V] tensors a chunk holds at once at most: logits, scaled and filtered copies,
# probabilities (the sort holds two); logprobs add one (the raw or processed logits).
LOGIT_COPIES = 5


def chunk_rows(memory_mib: int, vocab_size: int) -> int:
    """Rows of logits a chunk may hold within ``memory_mib`` MiB (at least one)."""
    return max(1, memory_mib * 2**20 // (vocab_size * 4 * LOGIT_COPIES))


def request_chunks(counts: list[int], max_rows: int) -> list[tuple[int, int]]:
    """Consecutive request ranges [first, last) with at most ``max_rows`` rows each, or one
    request where a single request has more (a request's rows are never split)."""
    chunks, first, rows = [], 0, 0
    for index, count in enumerate(counts):
        if index > first and rows + count > max_rows:
            chunks.append((first, index))
            first, rows = index, 0
        rows += count
    if first < len(counts):
        chunks.append((first, len(counts)))
    return chunks


@dataclasses.dataclass
class Proposals:
    """A step's proposals for its n block rows (request order)."""

    tokens: torch.Tensor  # [n] int64
    confidence: torch.Tensor  # [n] float32
    entropy: torch.Tensor | None = None  # [n] float32, when asked for
    # [m, 2 + 2k] float64 (``logprobs.columns``): the rows of requests asking for logprobs
    logprobs: torch.Tensor | None = None
    # [n, r] int64: each row's r best tokens after the logit stages (``ranked``), or None
    ranked: torch.Tensor | None = None
    # [n] int8: ``ROW_VALID``, or why the row's proposal means nothing (``sampling.ROW_*``)
    invalid: torch.Tensor | None = None

    @staticmethod
    def concat(parts: list[Proposals]) -> Proposals:
        def joined(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)
        return Proposals(*(joined(f.name) for f in dataclasses.fields(Proposals)))


class ProposalPipeline:
    def __init__(self, mask_token_id: int, confidence_rule: str = "sampled_token",
                 max_rows: int | None = None, logprobs_mode: str = "raw_logprobs",
                 ranked: int = 0) -> None:
        if confidence_rule not in CONFIDENCE_RULES:
            raise ValueError(f"confidence rule {confidence_rule!r}: expected one of "
                             f"{CONFIDENCE_RULES}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs mode {logprobs_mode!r}: expected one of "
                             f"{LOGPROBS_MODES}")
        self.mask_token_id = mask_token_id
        self.max_probability = confidence_rule == "max_probability"
        self.max_rows = max_rows  # rows of logits at once (None: the whole step)
        self.logprobs_mode = logprobs_mode
        self.ranked = ranked  # best tokens kept per row (0: none)
        self.logit_stages = [stage for stage in LOGIT_STAGES.values() if stage is not None]

    def propose(self, logits: torch.Tensor, counts: list[int], params: list,
                generators: list, output_index: torch.Tensor | None = None,
                seen_tokens: list | None = None, with_entropy: bool = False,
                output_canvas: list | None = None, logprobs_k: int | None = None,
                grammar_rows: list | None = None) -> Proposals:
        """logits: [n, V]; the other arguments as ``ProposalBatch``'s fields; logprobs_k:
        the step's largest top logprobs asked for (None: none asks)."""
        batch = ProposalBatch(logits.float(), counts, params, generators, output_index,
                              seen_tokens, output_canvas, grammar_rows)
        logprob_rows = raw = None
        if logprobs_k is not None:
            logprob_rows = torch.tensor([wants_logprobs(p) for p, n in zip(params, counts)
                                         for _ in range(n)], dtype=torch.bool)
            if self.logprobs_mode.startswith("raw"):
                raw = batch.logits[logprob_rows.to(batch.logits.device)].clone()
        for stage in self.logit_stages:
            stage(batch)
        batch.logits[:, self.mask_token_id] = float("-inf")
        # Caught here, where they arise: a row without a token or with non-finite logits
        # is drawn from a harmless stand-in and flagged, never committed.
        invalid = invalid_rows(batch.logits)
        drawn = draw_for_requests(batch.logits, counts, params, generators,
                                  max_probability=self.max_probability,
                                  with_entropy=with_entropy, invalid=invalid)
        proposals = Proposals(*drawn, invalid=invalid)
        if self.ranked:
            proposals.ranked = batch.logits.topk(self.ranked, dim=-1).indices
        if logprob_rows is not None:
            rows = logprob_rows.to(batch.logits.device)
            if raw is None:
                by_row = [p for p, n in zip(params, counts) for _ in range(n)]
                raw = processed_logits(batch.logits[rows],
                                       [p for p, keep in zip(by_row, logprob_rows) if keep])
            as_logits = self.logprobs_mode.endswith("logits")
            proposals.logprobs = columns(raw, proposals.tokens[rows], logprobs_k, as_logits)
            if any(getattr(p, "logprob_token_ids", None) for p in params):
                use_given_tokens(proposals.logprobs, distribution_values(raw, as_logits),
                                 counts, params)
        return proposals

    def propose_from_hidden(self, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            hidden: torch.Tensor, counts: list[int], params: list,
                            generators: list, output_index: torch.Tensor | None = None,
                            seen_tokens: list | None = None, with_entropy: bool = False,
                            output_canvas: list | None = None,
                            grammar_rows: list | None = None,
                            errors: dict[int, Exception] | None = None) -> Proposals:
        """``propose`` of ``compute_logits(hidden)`` ([n, H] -> [n, V]), a chunk of whole
        requests at a time so that at most ``max_rows`` rows of logits exist at once; draws
        run in request order, so the proposals are the same as without chunks. With
        ``errors``, a request that raises alone is recorded there (index -> exception) and
        its rows are proposed greedily without its constraints, flagged ``ROW_FAILED``."""
        def propose_range(first: int, last: int, row: int, stand_in: Any = None
                          ) -> Proposals:
            """Requests [first, last) from hidden row ``row``; ``stand_in``: one request's
            plain parameters in place of its own (no per-row context then)."""
            rows, requests = slice(row, row + sum(counts[first:last])), slice(first, last)

            def own(values: Any, span: slice) -> Any:
                return None if values is None or stand_in is not None else values[span]
            return self.propose(
                compute_logits(hidden[rows]), counts[requests],
                params[requests] if stand_in is None else [stand_in], generators[requests],
                own(output_index, rows), own(seen_tokens, requests), with_entropy,
                own(output_canvas, requests), logprobs_k, own(grammar_rows, requests))

        def isolating(first: int, last: int, row: int) -> Proposals:
            try:
                return propose_range(first, last, row)
            except Exception:  # noqa: BLE001 - narrowed to the failing requests below
                if errors is None:
                    raise
            parts = []
            for index in range(first, last):
                try:
                    parts.append(propose_range(index, index + 1, row))
                except Exception as err:  # noqa: BLE001 - isolated to this request
                    errors[index] = err
                    part = propose_range(index, index + 1, row, plain_params(params[index]))
                    part.invalid.fill_(ROW_FAILED)
                    parts.append(part)
                row += counts[index]
            return Proposals.concat(parts)

        logprobs_k = top_count(params)
        if self.max_rows is None or sum(counts) <= self.max_rows:
            return isolating(0, len(counts), 0)
        parts, row = [], 0
        for first, last in request_chunks(counts, self.max_rows):
            parts.append(isolating(first, last, row))
            row += sum(counts[first:last])
        return Proposals.concat(parts)


def plain_params(params):
    """Greedy sampling parameters asking for the same logprobs as ``params`` and nothing
    else: the stand-in that proposes the rows of a request whose own proposals raised."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, logprobs=params.logprobs,
                          logprob_token_ids=getattr(params, "logprob_token_ids", None))
