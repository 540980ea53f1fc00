"""FOCUS inside the forward: importance at two layers, then row selection.

``FocusStepHooks`` runs before the attention of layers ``L - 1`` and ``L`` (L =
``eviction_layer``). At L - 1 it keeps the queries and keys of every evicting request's
masked candidates; at L it computes the candidates' importance at both layers in one
call; then, once every row's keys/values are
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
        # [N, H, D] and [N, H_kv, D]: the candidates' queries and keys at layer L - 1
        self.first_layer: tuple[torch.Tensor, torch.Tensor] | None = None
        self.block_size = self.blocks[0].processing.shape[0] if self.blocks else 0
        # [n] the block of each evicting block row, in block order
        self.block_of_rows = torch.repeat_interleave(
            torch.arange(len(self.blocks)),
            torch.tensor([len(b.step_request.block_rows) for b in self.blocks],
                         dtype=torch.long))

    def before_attention(self, layer_input: LayerInput) -> RowSelection | None:
        if not self.blocks:
            return None
        rows = layer_input.current_rows(torch.cat([b.candidate_rows for b in self.blocks]))
        rows = rows.to(self.device)
        candidates = (layer_input.query[rows], layer_input.key[rows])  # [N, H(_kv), D]
        if layer_input.layer != self.eviction_layer:
            self.first_layer = candidates
            return None
        # Both layers' candidates in one batch of 2P blocks: layer L - 1's, then layer L's.
        sizes = [len(b.candidate_rows) for b in self.blocks]
        block_rows = torch.arange(2 * len(rows), device=self.device).split(sizes * 2)
        kernels = [b.step_request.request.policy_config.pool_kernel for b in self.blocks]
        importance = step_candidate_importance(
            torch.cat([self.first_layer[0], candidates[0]]),
            torch.cat([self.first_layer[1], candidates[1]]),
            list(block_rows), layer_input.scale, kernels * 2)
        return self._select(layer_input, importance[:len(sizes)], importance[len(sizes):])

    def _select(self, layer_input: LayerInput, first: list[torch.Tensor | None],
                second: list[torch.Tensor | None]) -> RowSelection | None:
        """Budgets and retained sets of every evicting block at once (``first``,
        ``second``: each block's candidate importance at layers L - 1 and L): tensor
        operations over the step's blocks, one host copy (the retained sets)."""
        blocks = self.blocks
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
