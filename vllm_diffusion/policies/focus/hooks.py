"""FOCUS inside the forward: importance at two layers, then row selection.

``FocusStepHooks`` runs before the attention of layers ``L - 1`` and ``L`` (L =
``eviction_layer``). At both it computes the importance of every evicting request's masked
candidates from that layer's queries and keys; at L, once every row's keys/values are
known (the attention stores them for all rows), it asks each request's state for its
budget, selects the retained positions for all requests in one batched call, and returns
the rows that continue. An evicting request's keys are cut after its rightmost retained
position: positions left of it have KV at every layer (placeholder integrity), positions
right of it may not. Rows that are not block rows of an evicting request (prefill and
commit rows, requests with ``evict=False`` and requests with a grammar) always continue.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_diffusion.attention.importance import step_candidate_importance
from vllm_diffusion.kernels.dispatch import kernel
from vllm_diffusion.kernels.selection import batched_token_budget, wanted_by_rate
from vllm_diffusion.step.hooks import (ForwardStep, LayerHooks, LayerInput, RowSelection,
                                       StepHooks, StepRequest)


@dataclasses.dataclass
class EvictingBlock:
    index: int  # the request's index in the step
    step_request: StepRequest
    processing: torch.Tensor  # [B] bool, block positions computed this step
    candidates: torch.Tensor  # [B] bool, masked positions (all processed)
    candidate_rows: torch.Tensor  # [n] step rows of the candidates, ascending


class FocusStepHooks(StepHooks):
    def __init__(self, step: ForwardStep, eviction_layer: int, mask_token_id: int) -> None:
        self.layers = LayerHooks(before_attention=(eviction_layer - 1, eviction_layer))
        self.eviction_layer = eviction_layer
        self.device = step.device
        self.blocks: list[EvictingBlock] = []
        for index, s in enumerate(step.requests):
            # A request with a grammar evicts nothing: the grammar's walk starts at the
            # leftmost undecided position and checks the positions right of it.
            if (s.request is None or not s.request.policy_config.evict
                    or s.request.grammar is not None):
                continue
            masked = s.request.canvas.masked(mask_token_id)
            processing = torch.zeros_like(masked)
            processing[s.block_positions] = True
            self.blocks.append(EvictingBlock(index, s, processing, processing & masked,
                                             s.masked_rows(mask_token_id)))
        self.importance: dict[int, list[torch.Tensor | None]] = {}
        self.block_size = self.blocks[0].processing.shape[0] if self.blocks else 0
        # [n] the block of each evicting block row, in block order
        self.block_of_rows = torch.repeat_interleave(
            torch.arange(len(self.blocks)),
            torch.tensor([len(b.step_request.block_rows) for b in self.blocks],
                         dtype=torch.long))

    def before_attention(self, layer_input: LayerInput) -> RowSelection | None:
        rows = [layer_input.current_rows(b.candidate_rows).to(self.device) for b in self.blocks]
        kernels = [b.step_request.request.policy_config.pool_kernel for b in self.blocks]
        self.importance[layer_input.layer] = step_candidate_importance(
            layer_input.query, layer_input.key, rows, layer_input.scale, kernels)
        if layer_input.layer != self.eviction_layer:
            return None
        return self._select(layer_input)

    def _select(self, layer_input: LayerInput) -> RowSelection | None:
        """Budgets and retained sets of every evicting block at once: tensor operations
        over the step's blocks, one host copy (the retained sets)."""
        blocks = self.blocks
        if not blocks:
            return None
        first, second = (self.importance[self.eviction_layer - 1],
                         self.importance[self.eviction_layer])
        device = self.device
        candidates = torch.stack([b.candidates for b in blocks]).to(device)  # [P, B]
        processing = torch.stack([b.processing for b in blocks]).to(device)
        delta = torch.zeros(candidates.shape, device=device)
        present = [i for i, after in enumerate(second) if after is not None]
        if present:  # candidates in block order, ascending positions: the masked order
            delta[candidates] = torch.cat([second[i] - first[i] for i in present]).float()
        states = [b.step_request.request.policy_state for b in blocks]
        configs = [b.step_request.request.policy_config for b in blocks]
        by_rate = torch.tensor([wanted_by_rate(c.alpha * s.mean_decoded, self.block_size)
                                for s, c in zip(states, configs)], device=device)
        budgets = batched_token_budget(delta, candidates, by_rate, self.block_size)
        retained = kernel("select_retained", device)(
            delta, candidates, budgets, processing,
            torch.stack([s.ever_processed for s in states]).to(device),
            torch.tensor([c.context_rule == "selected_left" for c in configs],
                         device=device)).cpu()
        processing = processing.cpu()
        changed = (retained != processing).any(dim=1)
        if not bool(changed.any()):
            return None
        keep = torch.ones(len(layer_input.rows), dtype=torch.bool)
        block_rows = torch.cat([b.step_request.block_rows for b in blocks])
        keep[layer_input.current_rows(block_rows)] = retained[
            self.block_of_rows, torch.cat([b.step_request.block_positions for b in blocks])]
        positions = torch.arange(retained.shape[1])
        rightmost = torch.where(retained, positions, -1).max(dim=1).values
        kv_lens = {blocks[i].index: blocks[i].step_request.request.canvas.start + end + 1
                   for i, end in zip(torch.nonzero(changed).flatten().tolist(),
                                     rightmost[changed].tolist())}
        return RowSelection(keep, kv_lens)
