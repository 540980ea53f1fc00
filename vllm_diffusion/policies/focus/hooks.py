"""FOCUS inside the forward (``FocusStepHooks``): before the attention of layers L - 1 and
L (L = ``eviction_layer``) it reads the evicting blocks' candidates' queries and keys, then
computes their importance at both layers in one call and selects every block's retained
positions in one batched call. An evicting request's keys are cut after its rightmost
retained position (positions left of it have KV at every layer, right of it may not);
rows that are not block rows of an evicting request always continue. Where logits are
shifted the grids are over the positions the rows decode (docs/policies.md, "focus").
"""

from __future__ import annotations

import torch

from vllm_diffusion.attention.importance import step_candidate_importance
from vllm_diffusion.kernels.dispatch import kernel
from vllm_diffusion.kernels.selection import batched_token_budget, wanted_by_rate
from vllm_diffusion.step.hooks import (ForwardStep, LayerHooks, LayerInput, RowSelection,
                                       StepHooks)
from vllm_diffusion.step.slots import SlotTable, block_tokens, slot_index


class FocusStepHooks(StepHooks):
    def __init__(self, step: ForwardStep, eviction_layer: int, mask_token_id: int,
                 ever_processed: SlotTable) -> None:
        self.layers = LayerHooks(before_attention=(eviction_layer - 1, eviction_layer))
        self.eviction_layer = eviction_layer
        self.device = step.device
        self.ever_processed = ever_processed  # [S, B] bool, the policy's
        # the evicting blocks: each one's request index in the step, and its StepRequest
        self.blocks = [(index, s) for index, s in enumerate(step.requests)
                       if s.request is not None and s.request.policy_config.evict
                       and not s.request.keep_all_rows]
        # [N, H, D] and [N, H_kv, D]: the candidates' queries and keys at layer L - 1
        self.first_layer: tuple[torch.Tensor, torch.Tensor] | None = None
        if not self.blocks:
            return
        requests = [s.request for _, s in self.blocks]
        self.slots = slot_index(requests)  # [P] each evicting block's slot
        # [n] over the evicting blocks' rows, in block order: each one's step row, block
        # and block position
        self.block_rows = torch.cat([s.block_rows for _, s in self.blocks])
        self.block_of_rows = torch.repeat_interleave(
            torch.arange(len(self.blocks)),
            torch.tensor([len(s.block_rows) for _, s in self.blocks], dtype=torch.long))
        self.positions = torch.cat([s.block_positions for _, s in self.blocks])
        masked = block_tokens([r.canvas for r in requests]) == mask_token_id  # [P, B]
        self.block_size = masked.shape[1]
        # [P, B] bool: the positions computed this step, and the masked ones among them
        self.processing = torch.zeros_like(masked)
        self.processing[self.block_of_rows, self.positions] = True
        self.candidates = self.processing & masked
        # [N] the candidates' step rows, in block order, ascending within a block
        self.candidate_rows = self.block_rows[masked[self.block_of_rows, self.positions]]
        self.candidate_counts = self.candidates.sum(dim=1).tolist()  # [P]

    def before_attention(self, layer_input: LayerInput) -> RowSelection | None:
        if not self.blocks:
            return None
        rows = layer_input.current_rows(self.candidate_rows).to(self.device)
        candidates = (layer_input.query[rows], layer_input.key[rows])  # [N, H(_kv), D]
        if layer_input.layer != self.eviction_layer:
            self.first_layer = candidates
            return None
        # Both layers' candidates in one batch of 2P blocks: layer L - 1's, then layer L's.
        sizes = self.candidate_counts
        block_rows = torch.arange(2 * len(rows), device=self.device).split(sizes * 2)
        kernels = [s.request.policy_config.pool_kernel for _, s in self.blocks]
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
        requests = [s.request for _, s in self.blocks]
        device = self.device
        candidates = self.candidates.to(device)  # [P, B]
        processing = self.processing.to(device)
        delta = torch.zeros(candidates.shape, device=device)
        present = [i for i, after in enumerate(second) if after is not None]
        if present:  # candidates in block order, ascending positions: the masked order
            delta[candidates] = torch.cat([second[i] - first[i] for i in present]).float()
        configs = [r.policy_config for r in requests]
        by_rate = torch.tensor([wanted_by_rate(c.alpha * r.policy_state.mean_decoded,
                                               self.block_size)
                                for r, c in zip(requests, configs)], device=device)
        budgets = batched_token_budget(delta, candidates, by_rate, self.block_size)
        ever_processed = self.ever_processed.covering(self.slots)[self.slots]  # [P, B]
        retained = kernel("select_retained", device)(
            delta, candidates, budgets, processing, ever_processed.to(device),
            torch.tensor([c.context_rule == "selected_left" for c in configs],
                         device=device)).cpu()
        changed = (retained != self.processing).any(dim=1)
        if not bool(changed.any()):
            return None
        keep = torch.ones(len(layer_input.rows), dtype=torch.bool)
        keep[layer_input.current_rows(self.block_rows)] = retained[self.block_of_rows,
                                                                   self.positions]
        positions = torch.arange(retained.shape[1])
        rightmost = torch.where(retained, positions, -1).max(dim=1).values
        kv_lens = {}
        for i, end in zip(torch.nonzero(changed).flatten().tolist(),
                          rightmost[changed].tolist()):
            index, block = self.blocks[i]
            # one past the rightmost kept row (a row is its decoded position - shift)
            kv_lens[index] = requests[i].canvas.start + end + 1 - block.logits_shift
            if block.logits_shift:  # the rows after the block rows stop too
                keep[layer_input.current_rows(
                    torch.arange(int(block.block_rows[-1]) + 1, block.rows.stop))] = False
        return RowSelection(keep, kv_lens)
