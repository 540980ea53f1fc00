"""Per-step glue between the runner, the FOCUS policy state and the eviction machinery."""

from __future__ import annotations

import torch

from vllm_diffusion.attention.eviction import EvictionStep, RequestEviction
from vllm_diffusion.attention.importance import ImportanceProbe
from vllm_diffusion.policies.focus import FocusRequestState
from vllm_diffusion.worker.step_plan import RequestRows


def block_row_starts(rows: list[RequestRows]) -> list[int | None]:
    """Index of each request's first block row in the step's query rows (None: no block)."""
    starts, offset = [], 0
    for r in rows:
        offset += len(r.positions)
        starts.append(None if r.canvas is None else offset - len(r.block_positions))
    return starts


def candidate_rows(rows: list[RequestRows], mask_token_id: int, device: torch.device,
                   evicting_only: bool = False) -> list[torch.Tensor | None]:
    """Query rows of every request's masked (candidate) block positions; with
    ``evicting_only``, None for requests whose options turn eviction off (no importance
    is computed for them)."""
    out = []
    for r, start in zip(rows, block_row_starts(rows)):
        if start is None or (evicting_only and not r.canvas.policy_config.evict):
            out.append(None)
            continue
        masked = r.canvas.tokens[r.block_positions] == mask_token_id
        out.append((start + torch.nonzero(masked).flatten()).to(device))
    return out


def eviction_step(rows: list[RequestRows], states: dict[str, FocusRequestState],
                  mask_token_id: int, block_size: int, device: torch.device) -> EvictionStep:
    probe = ImportanceProbe(candidate_rows(rows, mask_token_id, device, evicting_only=True),
                            [r.canvas.policy_config.pool_kernel if r.canvas else 3 for r in rows])
    requests = []
    for r, start in zip(rows, block_row_starts(rows)):
        if start is None:
            requests.append(None)
            continue
        processing = torch.zeros(block_size, dtype=torch.bool)
        processing[r.block_positions] = True
        config = r.canvas.policy_config
        requests.append(RequestEviction(
            state=states[r.req_id], config=config, block_start=r.canvas.start,
            block_rows=torch.arange(start, start + len(r.block_positions)),
            processing=processing, candidates=r.canvas.tokens == mask_token_id))
    return EvictionStep(requests, probe, sum(len(r.positions) for r in rows))


def surviving_block_positions(r: RequestRows, request: RequestEviction | None) -> torch.Tensor:
    """Block positions of a request whose hidden states reach the last layer."""
    if request is None or request.retained is None:
        return r.block_positions
    return r.block_positions[request.retained[r.block_positions]]


def hidden_rows(rows: list[RequestRows], step: EvictionStep | None,
                num_rows: int) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Per request: its surviving block positions; and all their rows in the model output."""
    index = torch.arange(num_rows)
    if step is not None and step.keep_rows is not None:
        index = torch.full((num_rows,), -1, dtype=torch.long)
        index[step.keep_rows.cpu()] = torch.arange(len(step.keep_rows))
    positions, out_rows = [], []
    for i, (r, start) in enumerate(zip(rows, block_row_starts(rows))):
        if start is None:
            positions.append(None)
            continue
        request = step.requests[i] if step is not None else None
        surviving = surviving_block_positions(r, request)
        in_block = torch.searchsorted(r.block_positions, surviving)
        positions.append(surviving)
        out_rows.append(index[start + in_block])
    return positions, (torch.cat(out_rows) if out_rows else torch.empty(0, dtype=torch.long))
