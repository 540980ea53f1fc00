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

    def before_attention(self, layer_input: LayerInput) -> RowSelection | None:
        rows = [layer_input.current_rows(b.candidate_rows).to(self.device) for b in self.blocks]
        kernels = [b.step_request.request.policy_config.pool_kernel for b in self.blocks]
        self.importance[layer_input.layer] = step_candidate_importance(
            layer_input.query, layer_input.key, rows, layer_input.scale, kernels)
        if layer_input.layer != self.eviction_layer:
            return None
        return self._select(layer_input)

    def _select(self, layer_input: LayerInput) -> RowSelection | None:
        first, second = (self.importance[self.eviction_layer - 1],
                         self.importance[self.eviction_layer])
        # Every block's candidate deltas in one host copy.
        present = [i for i, after in enumerate(second) if after is not None]
        host = (torch.cat([second[i] - first[i] for i in present]).float().cpu().split(
            [len(second[i]) for i in present]) if present else [])
        host_delta = dict(zip(present, host))
        evicting, deltas, budgets = [], [], []
        for index, block in enumerate(self.blocks):
            state = block.step_request.request.policy_state
            config = block.step_request.request.policy_config
            delta = torch.zeros(block.processing.shape[0])
            if index in host_delta:
                delta[block.candidates] = host_delta[index]
            budget = state.budget(delta, block.candidates, config)
            if budget is not None:
                evicting.append(block)
                deltas.append(delta)
                budgets.append(budget)
        if not evicting:
            return None
        device = self.device
        retained = kernel("select_retained", device)(
            torch.stack(deltas).to(device),
            torch.stack([b.candidates for b in evicting]).to(device),
            torch.tensor(budgets, device=device),
            torch.stack([b.processing for b in evicting]).to(device),
            torch.stack([b.step_request.request.policy_state.ever_processed
                         for b in evicting]).to(device),
            torch.tensor([b.step_request.request.policy_config.context_rule == "selected_left"
                          for b in evicting], device=device)).cpu()
        keep = torch.ones(len(layer_input.rows), dtype=torch.bool)
        kv_lens = {}
        for block, kept in zip(evicting, retained):
            s = block.step_request
            keep[layer_input.current_rows(s.block_rows)] = kept[s.block_positions]
            if not torch.equal(kept, block.processing):
                rightmost = int(torch.nonzero(kept).max())
                kv_lens[block.index] = s.request.canvas.start + rightmost + 1
        return RowSelection(keep, kv_lens)
