"""A step's proposals on the host: its one device-to-host copy, scattered onto the [R, B]
grid of the step's R denoised blocks of B positions.

The pipeline (``proposal.py``) returns one row per computed block position, in request
order; the policies decide over whole blocks. Tokens, confidences (and entropies, the
ranked alternatives and the logprob columns, where asked for) travel to the host
together in one copy, as float64, which holds every token id exactly.
"""

from __future__ import annotations

import dataclasses

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
    columns = [proposed.tokens, proposed.confidence, proposed.invalid]
    if proposed.entropy is not None:
        columns.append(proposed.entropy)
    if proposed.ranked is not None:
        columns += list(proposed.ranked.T)
    parts = [torch.stack([c.double() for c in columns]).flatten()]
    if proposed.logprobs is not None:
        parts.append(proposed.logprobs.flatten())
    host = torch.cat(parts).cpu()
    n = len(proposed.tokens)
    table = host[:len(columns) * n].view(len(columns), n)
    block, position = where[:, 0], where[:, 1]
    shape = (num_blocks, block_size)
    grid = ProposalGrid(torch.full(shape, mask_token_id, dtype=torch.long),
                        torch.full(shape, float("-inf")), torch.zeros(shape, dtype=torch.bool))
    grid.tokens[block, position] = table[0].long()
    grid.confidence[block, position] = table[1].float()
    grid.computed[block, position] = True
    grid.invalid = torch.zeros(shape, dtype=torch.int8)
    grid.invalid[block, position] = table[2].to(torch.int8)
    if proposed.entropy is not None:
        grid.entropy = torch.zeros(shape)
        grid.entropy[block, position] = table[3].float()
    if proposed.ranked is not None:
        width = proposed.ranked.shape[1]
        grid.ranked = torch.zeros(*shape, width, dtype=torch.long)
        grid.ranked[block, position] = table[len(columns) - width:].T.long()
    if proposed.logprobs is not None:
        width = proposed.logprobs.shape[1]
        asking = torch.tensor(asks_logprobs, dtype=torch.bool)[block]
        grid.logprobs = torch.zeros(*shape, width, dtype=torch.float64)
        grid.logprobs[block[asking], position[asking]] = host[len(columns) * n:].view(-1, width)
    return grid
