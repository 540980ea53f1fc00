"""A plain-PyTorch reference of chunked decoding (Optimus's streaming window, with or
without its prefix reuse) on a model whose logits are shifted (Fast-dLLM v2's form: block
position j is read from row j - 1), greedy, one sequence.

The model, its block loop and the layer-by-layer forward over a per-layer block store are
``reference_focus_shifted``'s. Per step, with chunk c: the window ends after the c-th
masked position (the whole block once no more than c are masked); the rows computed are
the window's (with reuse, those the neighbour cache has not frozen, and every masked
one), the keys stop at the window's end; each computed row but the last decodes the
position after it. Choices the paper (on models whose rows predict their own positions)
does not make, as the engine makes them: the window is of rows, so rows 0..E-1 read
positions 1..E-1; the neighbour cache decides rows (a row computed this step is frozen
once its token and the one after it were decoded before the step; nothing is frozen
before the block's first step).
"""

from __future__ import annotations

import torch
from reference_fast_dllm_v2 import ReferenceFastDLLMv2
from reference_focus import proposals
from reference_focus_shifted import forward_rows, generate_by_shifted_blocks
from reference_sdar import select_positions, transfer_quotas


@torch.no_grad()
def reference_chunked_shifted_generate(model: ReferenceFastDLLMv2, prompt: list[int], *,
                                       block_size: int, mask_id: int, max_tokens: int,
                                       chunk: int, reuse: bool, strategy: str,
                                       threshold: float) -> list[int]:
    """Greedy, no stop token; ``max_tokens`` output tokens."""
    num_layers = model.config["num_hidden_layers"]
    quotas = transfer_quotas(block_size, block_size)
    positions = torch.arange(block_size)

    def denoise(block: torch.Tensor, past) -> torch.Tensor:
        start = 0 if past is None else past[0][0].shape[1]
        store_k = [torch.zeros(model.num_kv_heads, block_size, model.head_dim)
                   for _ in range(num_layers)]  # per layer [Hkv, B, D]
        store_v = [torch.zeros_like(k) for k in store_k]
        uncached = torch.ones(block_size, dtype=torch.bool)  # rows not frozen
        warm, step = False, 0
        while bool((block == mask_id).any()):
            masked = block == mask_id
            undecided = torch.nonzero(masked).flatten()
            end = block_size if len(undecided) <= chunk else int(undecided[chunk - 1]) + 1
            processed = positions < end
            if reuse and warm and bool(uncached.any()):
                processed &= masked | uncached
            rows = torch.nonzero(processed).flatten()
            x = forward_rows(model, block, rows, start, past, store_k, store_v, end)
            read = rows[:-1] + 1  # the positions the rows but the last decode
            confidence, proposal = proposals(model._logits(x[:-1]), read, block_size, mask_id)
            eligible = torch.zeros(block_size, dtype=torch.bool)
            eligible[read] = True
            candidates = masked & eligible
            confidence = torch.where(candidates, confidence,
                                     torch.full_like(confidence, float("-inf")))
            quota = quotas[step] if step < block_size else block_size
            commit = select_positions(strategy, confidence, candidates, quota, threshold,
                                      last_step=step >= block_size - 1)
            block = torch.where(commit, proposal, block)
            decoded = ~masked
            right_decoded = torch.ones_like(decoded)
            right_decoded[:-1] = decoded[1:]
            uncached &= ~(decoded & right_decoded & processed)
            warm, step = True, step + 1
            assert step <= 64 * block_size
        return block

    return generate_by_shifted_blocks(model, prompt, block_size, mask_id, max_tokens,
                                      denoise)
