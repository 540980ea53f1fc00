"""A step's proposals on the host: its one device-to-host copy (float64, exact for token
ids), scattered onto the [R, B] grid of the step's R denoised blocks of B positions.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from vllm_diffusion.worker.proposal import Proposals


@dataclasses.dataclass
class ProposalGrid:
    tokens: torch.Tensor  # [R, B] int64, mask_token_id where not computed
    confidence: torch.Tensor  # [R, B] float32, -inf where not computed
    computed: torch.Tensor  # [R, B] bool: positions with a proposal this step
    # [R, B] int8: ``sampling.ROW_*`` of each computed position's proposal (0 elsewhere)
    invalid: torch.Tensor | None = None
    entropy: torch.Tensor | None = None  # [R, B] float32 (0 where not computed)
    ranked: torch.Tensor | None = None  # [R, B, r] int64: each position's r best tokens
    # [R, B, 2 + 2k] float64 logprob columns, filled for the blocks that asked for them
    logprobs: torch.Tensor | None = None


def scatter_to_host(proposed: Proposals, where: torch.Tensor, num_blocks: int,
                    block_size: int, mask_token_id: int,
                    asks_logprobs: list[bool] | None = None) -> ProposalGrid:
    """``where``: [n, 2] (block, position) of each proposal row; ``asks_logprobs``: per
    block, whether its request asked for logprobs (the rows ``proposed.logprobs`` has)."""
    tokens, confidence, invalid, entropy, ranked, logprobs = one_copy_to_host(proposed)
    n = len(tokens)
    shape = (num_blocks, block_size)
    # every position of every block, in order (the common step): the columns are the grid
    dense = n == num_blocks * block_size and torch.equal(where, _whole_grid(*shape))
    block, position = where[:, 0], where[:, 1]

    def place(values: torch.Tensor, fill: float, dtype: torch.dtype) -> torch.Tensor:
        """[R, B, ...] of ``values`` ([n, ...]) at the proposals' places, ``fill``
        elsewhere."""
        if dense:
            return values.to(dtype).reshape(*shape, *values.shape[1:])
        grid = torch.full((*shape, *values.shape[1:]), fill, dtype=dtype)
        grid[block, position] = values.to(dtype)
        return grid

    grid = ProposalGrid(place(tokens, mask_token_id, torch.long),
                        place(confidence, float("-inf"), torch.float32),
                        torch.ones(shape, dtype=torch.bool) if dense
                        else place(torch.ones(n, dtype=torch.bool), False, torch.bool),
                        place(invalid, 0, torch.int8),
                        None if entropy is None else place(entropy, 0.0, torch.float32),
                        None if ranked is None else place(ranked, 0, torch.long))
    if logprobs is not None:
        asking = torch.tensor(asks_logprobs, dtype=torch.bool)[block]
        grid.logprobs = torch.zeros(*shape, logprobs.shape[1], dtype=torch.float64)
        grid.logprobs[block[asking], position[asking]] = logprobs
    return grid


def one_copy_to_host(proposed: Proposals) -> tuple[torch.Tensor | None, ...]:
    """The proposals' tensors on the host as float64 views of one copy: tokens [n],
    confidence [n], invalid [n], entropy [n], ranked [n, r] and logprobs [m, C] (None
    where absent). One copy on every device (one device read per step,
    ``tests/test_host_reads.py``)."""
    n = len(proposed.tokens)
    columns = [proposed.tokens, proposed.confidence, proposed.invalid]
    if proposed.entropy is not None:
        columns.append(proposed.entropy)
    if proposed.ranked is not None:
        columns += list(proposed.ranked.T)
    parts = [torch.stack([c.double() for c in columns]).flatten()]
    if proposed.logprobs is not None:
        parts.append(proposed.logprobs.flatten())
    host = torch.cat(parts).cpu()
    table = host[:len(columns) * n].view(len(columns), n)
    width = 0 if proposed.ranked is None else proposed.ranked.shape[1]
    return (table[0], table[1], table[2],
            None if proposed.entropy is None else table[3],
            None if proposed.ranked is None else table[len(columns) - width:].T,
            None if proposed.logprobs is None
            else host[len(columns) * n:].view(-1, proposed.logprobs.shape[1]))


@functools.lru_cache(maxsize=256)
def _whole_grid(num_blocks: int, block_size: int) -> torch.Tensor:
    """[R * B, 2] int64: every (block, position) pair in order (shared, never written)."""
    blocks = torch.arange(num_blocks).repeat_interleave(block_size)
    return torch.stack([blocks, torch.arange(block_size).repeat(num_blocks)], 1)
