"""What one denoising step computes for each scheduled request (block-causal). With
committed prefix C, known tokens F and a step reaching ``C + N``: if ``C + N >= F``, the
commit of ``[C, F // B * B)``, then the current block's canvas, keys to the block's end,
logits for the block rows only; otherwise (a partial prefill chunk) the whole blocks of
``[C, C + N)``, no logits.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import torch

from vllm_diffusion.policies.base import DecodingPolicy
from vllm_diffusion.step.hooks import ForwardStep, StepRequest
from vllm_diffusion.step.request import BlockCanvas, DiffusionRequest
from vllm_diffusion.worker.geometry import BlockGeometry


class KnownTokens:
    """A request's prompt and emitted output as one read-only sequence, without copying
    either (planning reads only the step's few rows)."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, index: slice) -> list[int]:
        start, stop, _ = index.indices(len(self))
        split = len(self.prompt)
        return (list(self.prompt[start:min(stop, split)])
                + self.output[max(start - split, 0):max(stop - split, 0)])


@dataclasses.dataclass
class RequestRows:
    req_id: str
    positions: list[int]
    token_ids: list[int]
    kv_len: int
    committed: int  # the committed prefix once this step ran
    request: DiffusionRequest | None  # None: prefill-only rows, no logits
    # [n] block-relative positions computed this step: the request's last n rows, or the n
    # rows from ``block_row_start`` where later rows follow the block (full attention)
    block_positions: torch.Tensor | None = None
    reused_commit: bool = False  # the block it commits keeps its last forward's KV
    block_row_start: int | None = None  # the block's first row among the request's rows
    # full attention under an approximate cache: this step rewrites every position's KV
    kv_refresh: bool = False
    # computed masked positions commit whatever the policy chooses (Dream's cached refresh)
    commit_candidates: bool = False
    # proposals are the argmax at any temperature (a shifted model's block's first token)
    argmax_proposals: bool = False
    logits_shift: int = 0  # rows before a block position its logits are read from

    @property
    def canvas(self) -> BlockCanvas | None:
        return self.request.canvas if self.request is not None else None


def plan_request(req_id: str, token_ids: KnownTokens | list[int], num_computed: int,
                 num_scheduled: int, geometry: BlockGeometry, mask_token_id: int,
                 request: DiffusionRequest, policy: DecodingPolicy,
                 resumed: bool = False) -> RequestRows:
    """Rows of one request for this step; moves the request to its current block. Tells
    the policy when the block starts (new, or its KV lost) and asks for the step's plan:
    positions to compute, key reach, and which positions of the block just completed the
    commit recomputes. A block whose last step computed it whole and changed nothing
    (``BlockCanvas.final_kv``) is committed with no recomputation."""
    geometry.check_committed(req_id, num_computed)
    num_tokens = len(token_ids)
    committed = geometry.committed_after_step(num_computed, num_scheduled, num_tokens)
    if not geometry.reaches_block(num_computed, num_scheduled, num_tokens):
        return RequestRows(req_id, list(range(num_computed, committed)),
                           token_ids[num_computed:committed], committed, committed, None)
    block_size = geometry.block_size
    block_start = geometry.block_start(num_tokens)
    previous = request.canvas
    canvas = request.block_for(block_start, token_ids[block_start:], block_size,
                               mask_token_id)
    new_block = canvas is not previous
    # Recomputing the committed prefix of the same block (a resumed preemption) means the
    # block's KV pages were freed.
    kv_lost = resumed or num_computed < block_start
    plan = policy.plan_step(request, "new" if new_block else "resumed" if kv_lost else None)
    commit = list(range(num_computed, block_start))
    commit_tokens = token_ids[num_computed:block_start]
    commits_previous = (len(commit) == block_size and previous is not None
                        and previous.start == num_computed)
    reused = commits_previous and previous.final_kv and not resumed
    if reused:
        commit, commit_tokens = [], []  # its last forward wrote the final KV
    elif plan.commit_recompute is not None and commits_previous:
        kept = plan.commit_recompute.tolist()
        commit = [p for p, k in zip(commit, kept) if k]
        commit_tokens = [t for t, k in zip(commit_tokens, kept) if k]
    kv_len = block_start + (block_size if plan.key_end is None else plan.key_end)
    if plan.compute is None:  # the whole block
        return RequestRows(
            req_id, commit + list(range(block_start, block_start + block_size)),
            commit_tokens + canvas.tokens.tolist(), kv_len, committed, request,
            whole_block(block_size), reused)
    computed = torch.nonzero(plan.compute).flatten()
    return RequestRows(
        req_id, commit + (computed + block_start).tolist(),
        commit_tokens + canvas.tokens[computed].tolist(), kv_len, committed, request,
        computed, reused)


class BlockPlanner:
    """Plans block-causal steps (``plan_request``) for the runner."""

    def __init__(self, geometry: BlockGeometry, mask_token_id: int) -> None:
        self.geometry, self.mask_token_id = geometry, mask_token_id

    def plan(self, req_id: str, token_ids: KnownTokens, num_computed: int, num_scheduled: int,
             request: DiffusionRequest, policy: DecodingPolicy, resumed: bool,
             max_tokens: int) -> RequestRows:
        return plan_request(req_id, token_ids, num_computed, num_scheduled, self.geometry,
                            self.mask_token_id, request, policy, resumed)


@functools.lru_cache(maxsize=8)
def whole_block(block_size: int) -> torch.Tensor:
    """[B] int64: 0..B-1 (shared, never written)."""
    return torch.arange(block_size)


def gather_step(rows: list[RequestRows], device: torch.device) -> ForwardStep:
    """What the policy's forward hooks see of a step's rows."""
    requests, offset = [], 0
    for r in rows:
        span = range(offset, offset + len(r.positions))
        offset = span.stop
        if r.request is None:
            requests.append(StepRequest(None, span, None, None))
            continue
        first_block_row = (span.stop - len(r.block_positions) if r.block_row_start is None
                           else span.start + r.block_row_start)
        requests.append(StepRequest(r.request, span,
                                    torch.arange(first_block_row,
                                                 first_block_row + len(r.block_positions)),
                                    r.block_positions, r.kv_len, r.logits_shift))
    return ForwardStep(requests, offset, device)


def emit_final_tokens(block_tokens: list[int], block_start: int, num_tokens: int,
                      mask_token_id: int) -> list[int]:
    """Decoded tokens of the block (``block_tokens``, from ``block_start``) extending the
    request's ``num_tokens`` known tokens without a gap: its newly final tokens."""
    pending = block_tokens[num_tokens - block_start:]
    return list(itertools.takewhile(lambda token: token != mask_token_id, pending))


def decode_steps(canvas: BlockCanvas, num_tokens: int, count: int) -> list[int]:
    """The steps that unmasked the ``count`` block tokens following the known tokens."""
    offset = num_tokens - canvas.start
    return canvas.decoded_at[offset:offset + count].tolist()


@dataclasses.dataclass
class StepInputs:
    """The model inputs of a step's rows (host tensors, moved to the device by the runner)."""

    token_ids: torch.Tensor  # [T] int32, as vLLM's runners pass them
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64 KV slot of each row
    block_table: torch.Tensor  # [R, max_pages] int64 page ids per request
    query_start_loc: list[int]  # R + 1 row offsets
    kv_lens: list[int]  # R key counts


def step_inputs(rows: list[RequestRows], page_ids: list[list[int]],
                page_size: int) -> StepInputs:
    """The inputs of the planned ``rows``; ``page_ids[r]``: request r's KV pages."""
    # A few rows per request: built as lists and made tensors once each.
    positions = [p for r in rows for p in r.positions]
    slots = [pages[p // page_size] * page_size + p % page_size
             for r, pages in zip(rows, page_ids) for p in r.positions]
    width = max((len(pages) for pages in page_ids), default=0)
    table = [[*pages, *[0] * (width - len(pages))] for pages in page_ids]
    query_start_loc = [0, *itertools.accumulate(len(r.positions) for r in rows)]
    # int32 as vLLM's own runners pass them: a compiled forward is traced once, with
    # guards dropped, for the dtype its warm-up saw (int64 ids would be misread).
    token_ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.int32)
    positions = torch.tensor(positions, dtype=torch.long)
    slots = torch.tensor(slots, dtype=torch.long)
    table = torch.tensor(table, dtype=torch.long).view(len(page_ids), width)
    return StepInputs(token_ids, positions, slots, table, query_start_loc,
                      [r.kv_len for r in rows])


def stop_tokens(params: Any) -> frozenset[int]:
    """The tokens that end a request's output: ``stop_token_ids`` and its EOS (vLLM leaves
    ``eos_token_id`` unset under ``ignore_eos``)."""
    stops = set(params.stop_token_ids or ())
    if params.eos_token_id is not None:
        stops.add(params.eos_token_id)
    return frozenset(stops)


def truncate_at_stop(tokens: list[int], params: Any, num_output: int) -> list[int]:
    """Cut newly final tokens after a stop token or at max_tokens (as vLLM's stop check)."""
    stops = stop_tokens(params)
    tokens = tokens[:max(params.max_tokens - num_output, 0)]
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i + 1]
    return tokens


def denoised_blocks(rows: list[RequestRows], step: ForwardStep, out_rows: torch.Tensor
                    ) -> tuple[list[RequestRows], list[int], torch.Tensor, torch.Tensor]:
    """The step's denoised blocks (their requests' rows), how many of each block's
    positions reached the model output, and over all those rows (in request order): each
    row's output index and its (block, position) pair [n, 2]."""
    entries = [(r, s) for r, s in zip(rows, step.requests) if r.request is not None]
    if not entries:
        return [], [], torch.empty(0, dtype=torch.long), torch.empty(0, 2, dtype=torch.long)
    # A few rows per block: mapped in Python, made tensors once.
    output_index = [-1] * step.num_rows  # step row -> its row of the output
    for output_row, step_row in enumerate(out_rows.tolist()):
        output_index[step_row] = output_row
    counts, index, where = [], [], []
    for block, (r, s) in enumerate(entries):
        count = 0
        for step_row, position in zip(s.block_rows.tolist(), s.block_positions.tolist()):
            if output_index[step_row] >= 0:
                index.append(output_index[step_row])
                where.append((block, position))
                count += 1
        counts.append(count)
    return ([r for r, _ in entries], counts, torch.tensor(index, dtype=torch.long),
            torch.tensor(where, dtype=torch.long).view(len(where), 2))
