"""What one denoising step computes for each scheduled request.

For a request with committed prefix C (a multiple of B), known tokens F (prompt plus
emitted output) and a scheduled range reaching ``C + N``:

- if ``C + N >= F``: the rows are the commit/prefill of ``[C, F // B * B)`` with their real
  tokens, then the current block ``[F // B * B, + B)`` with its canvas (fixed tokens, decoded
  tokens and masks); keys visible up to the block end; logits for the block rows only.
- otherwise (a partial prefill chunk): the rows are the whole blocks of ``[C, C + N)``;
  no logits.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class BlockCanvas:
    """The current block of one request, as the runner denoises it."""

    start: int  # absolute position of the block's first token
    tokens: torch.Tensor  # [B] int64 (host), mask_token_id where undecided
    policy_config: object
    steps: int = 0  # denoising steps taken on this block
    first_step: int = 0  # the request's denoising steps before this block
    # [B] int64 (host): the request's denoising step (0-based) that unmasked each position;
    # -1 where the position is fixed (prompt tail) or still masked
    decoded_at: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.decoded_at is None:
            self.decoded_at = torch.full_like(self.tokens, -1)

    def commit(self, positions: torch.Tensor, proposals: torch.Tensor) -> None:
        """Unmask ``positions`` ([B] bool) with ``proposals`` ([B] int64); one step done."""
        self.tokens[positions] = proposals[positions]
        self.decoded_at[positions] = self.first_step + self.steps
        self.steps += 1


@dataclasses.dataclass
class RequestRows:
    req_id: str
    positions: list[int]
    token_ids: list[int]
    kv_len: int
    canvas: BlockCanvas | None  # None: prefill-only rows, no logits
    # [n] block-relative positions computed this step (the request's last n rows)
    block_positions: torch.Tensor | None = None


def plan_request(req_id: str, token_ids: list[int], num_computed: int,
                 num_scheduled: int, block_size: int, mask_token_id: int,
                 canvas: BlockCanvas | None, policy_config: object,
                 processing=None, commit_positions: torch.Tensor | None = None) -> RequestRows:
    """Rows of one request for this step; creates or reuses the request's canvas.

    ``processing(canvas) -> [B] bool`` picks the block positions to compute (default: all).
    ``commit_positions``: [B] bool; when the step commits exactly one completed block, only
    these of its positions are recomputed (the others keep their cached KV).
    """
    if num_computed % block_size:
        raise RuntimeError(
            f"request {req_id}: committed prefix {num_computed} is not on a diffusion "
            f"block boundary ({block_size})")
    num_tokens = len(token_ids)
    end = num_computed + num_scheduled
    if end < num_tokens:
        prefill_end = end // block_size * block_size
        return RequestRows(req_id, list(range(num_computed, prefill_end)),
                           token_ids[num_computed:prefill_end], prefill_end, None)
    block_start = num_tokens // block_size * block_size
    if canvas is None or canvas.start != block_start:
        tokens = torch.full((block_size,), mask_token_id, dtype=torch.long)
        fixed = token_ids[block_start:]
        tokens[:len(fixed)] = torch.tensor(fixed, dtype=torch.long)
        first_step = canvas.first_step + canvas.steps if canvas is not None else 0
        canvas = BlockCanvas(block_start, tokens, policy_config, first_step=first_step)
    block_end = block_start + block_size
    computed = (torch.arange(block_size) if processing is None
                else torch.nonzero(processing(canvas)).flatten())
    commit = list(range(num_computed, block_start))
    if commit_positions is not None and len(commit) == block_size:
        commit = [p for p, keep in zip(commit, commit_positions.tolist()) if keep]
    return RequestRows(
        req_id, commit + (computed + block_start).tolist(),
        [token_ids[p] for p in commit] + canvas.tokens[computed].tolist(), block_end,
        canvas, computed)


def emit_final_tokens(canvas: BlockCanvas, num_tokens: int, mask_token_id: int) -> list[int]:
    """Decoded tokens extending the request's known tokens without a gap (final tokens)."""
    tokens = canvas.tokens.tolist()
    run = []
    for token in tokens[num_tokens - canvas.start:]:
        if token == mask_token_id:
            break
        run.append(token)
    return run


def decode_steps(canvas: BlockCanvas, num_tokens: int, count: int) -> list[int]:
    """The steps that unmasked the ``count`` block tokens following the known tokens."""
    offset = num_tokens - canvas.start
    return canvas.decoded_at[offset:offset + count].tolist()
