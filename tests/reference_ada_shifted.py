"""A plain-PyTorch reference of Ada-DLM on a model whose logits are shifted (Fast-dLLM v2's
form: block position j is read from row j - 1), greedy, whole-block forwards (no
intra-block cache), one sequence.

The model, its block loop and the layer-by-layer forward are ``reference_focus_shifted``'s;
the freeze rule is ``reference_early_skip.ada_freeze``. Choices the paper (on models whose
rows predict their own positions) does not make, as the engine makes them: each step
computes the whole block, rows 0..B-2 decode positions 1..B-1 (the block's first position
is read from the previous block's commit, as Fast-dLLM v2's loop does, and is never one of
the rule's candidates); a position's confidence history is that of the row that decodes
it; K = ceil(capacity * B) counts the block's B positions.
"""

from __future__ import annotations

import torch
from reference_early_skip import ada_freeze
from reference_fast_dllm_v2 import ReferenceFastDLLMv2
from reference_focus import proposals
from reference_focus_shifted import forward_rows, generate_by_shifted_blocks


@torch.no_grad()
def reference_ada_shifted_generate(model: ReferenceFastDLLMv2, prompt: list[int], *,
                                   block_size: int, mask_id: int, max_tokens: int,
                                   capacity: float, history: int,
                                   confidence_floor: float = 0.0,
                                   static_threshold: float | None = None) -> list[int]:
    """Greedy, no stop token; ``max_tokens`` output tokens."""
    num_layers = model.config["num_hidden_layers"]
    rows = torch.arange(block_size)

    def denoise(block: torch.Tensor, past) -> torch.Tensor:
        start = 0 if past is None else past[0][0].shape[1]
        store_k = [torch.zeros(model.num_kv_heads, block_size, model.head_dim)
                   for _ in range(num_layers)]  # per layer [Hkv, B, D]
        store_v = [torch.zeros_like(k) for k in store_k]
        trajectory = [[0.0] * history for _ in range(block_size)]
        steps = 0
        while bool((block == mask_id).any()):
            masked = (block == mask_id).tolist()
            x = forward_rows(model, block, rows, start, past, store_k, store_v, block_size)
            read = rows[:-1] + 1  # the positions rows 0..B-2 decode
            confidence, proposal = proposals(model._logits(x[:-1]), read, block_size, mask_id)
            candidates = [m and i > 0 for i, m in enumerate(masked)]
            for i in range(block_size):
                if candidates[i]:
                    trajectory[i] = [float(confidence[i])] + trajectory[i][:-1]
            frozen = ada_freeze(confidence.tolist(), candidates, trajectory, capacity,
                                confidence_floor, static_threshold)
            block = torch.where(torch.tensor(frozen), proposal, block)
            steps += 1
            assert steps <= block_size
        return block

    return generate_by_shifted_blocks(model, prompt, block_size, mask_id, max_tokens,
                                      denoise)
