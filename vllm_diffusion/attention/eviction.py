"""Token eviction after layer 1 (FOCUS), applied inside vLLM's own Qwen3 layers.

One ``EvictionStep`` travels with a step's attention metadata. Layer 0's and layer 1's
attention report the candidates' importance (the ``ImportanceProbe``); after layer 1 has
stored the keys/values of every processed row, ``select`` asks each request's FOCUS state
for its retained block positions and compacts the shared metadata to the kept rows, so
layer 1's attention and every later layer run only on them. An evicting request's keys
are then cut after its rightmost retained position (FOCUS): positions left of it have KV
at every layer (placeholder integrity), positions right of it may not. Two forward
pre-hooks finish the compaction of the model's own tensors:

- before layer 1's ``post_attention_layernorm``: hidden states and residual;
- before each layer from 2 on: the positions (for RoPE).

Rows that are not block rows of a FOCUS request (prefill and commit rows) are always kept.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from vllm.forward_context import get_forward_context, is_forward_context_available

from vllm_diffusion.attention.compaction import compaction_kernel
from vllm_diffusion.attention.importance import ImportanceProbe
from vllm_diffusion.policies.focus_selection import selection_kernel

EVICTION_LAYER = 1


@dataclasses.dataclass
class RequestEviction:
    """One request's block in this step."""

    state: object  # FocusRequestState
    config: object  # FocusPolicyConfig
    block_start: int
    block_rows: torch.Tensor  # [n] query rows of the processed block positions, ascending
    processing: torch.Tensor  # [B] bool, block positions computed this step
    candidates: torch.Tensor  # [B] bool, masked positions (all processed)
    retained: torch.Tensor | None = None  # [B] bool, set at layer 1


@dataclasses.dataclass
class EvictionStep:
    requests: list[RequestEviction | None]  # per request of the batch
    probe: ImportanceProbe
    num_rows: int
    keep_rows: torch.Tensor | None = None  # query rows kept after layer 1; None: all

    def select(self, metadata) -> None:
        """Choose the retained positions of every request and compact ``metadata``."""
        keep = torch.ones(self.num_rows, dtype=torch.bool)
        evicting, deltas, budgets = [], [], []
        for index, request in enumerate(self.requests):
            if request is None:
                continue
            delta = torch.zeros(request.processing.shape[0])
            scores = self.probe.delta(index)
            if scores is not None:
                delta[request.candidates] = scores[0].cpu()
            budget = request.state.budget(delta, request.candidates, request.config)
            request.retained = request.processing.clone()
            if budget is not None:
                evicting.append(request)
                deltas.append(delta)
                budgets.append(budget)
        if evicting:
            device = metadata.query_positions.device
            retained = selection_kernel(device)(
                torch.stack(deltas).to(device),
                torch.stack([r.candidates for r in evicting]).to(device),
                torch.tensor(budgets, device=device),
                torch.stack([r.processing for r in evicting]).to(device),
                torch.stack([r.state.ever_processed for r in evicting]).to(device)).cpu()
            for request, kept in zip(evicting, retained):
                request.retained = kept
        for index, request in enumerate(self.requests):
            if request is None:
                continue
            processed_positions = torch.nonzero(request.processing).flatten()
            keep[request.block_rows.cpu()] = request.retained[processed_positions]
            if not torch.equal(request.retained, request.processing):
                rightmost = int(torch.nonzero(request.retained).max())
                metadata.kv_lens[index] = request.block_start + rightmost + 1
        if bool(keep.all()):
            return
        self.keep_rows = torch.nonzero(keep).flatten().to(metadata.query_positions.device)
        metadata.compact(self.keep_rows, keep)


def _current_eviction() -> EvictionStep | None:
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = next(iter(metadata.values()), None)
    step = getattr(metadata, "eviction", None)
    return step if step is not None and step.keep_rows is not None else None


def _compact_hidden_and_residual(module: nn.Module, args: tuple):
    step = _current_eviction()
    if step is None or args[0].shape[0] != step.num_rows:
        return None
    hidden, residual = args[0], args[1] if len(args) > 1 else None
    hidden, residual = compaction_kernel(hidden.device)(hidden, residual, step.keep_rows)
    return (hidden, residual, *args[2:]) if len(args) > 1 else (hidden,)


def _compact_positions(module: nn.Module, args: tuple):
    step = _current_eviction()
    if step is None or args[0].shape[-1] != step.num_rows:
        return None
    positions, *rest = args
    return (positions[..., step.keep_rows], *rest)


def install_eviction_hooks(layers: nn.ModuleList) -> None:
    if len(layers) <= EVICTION_LAYER:
        return
    layers[EVICTION_LAYER].post_attention_layernorm.register_forward_pre_hook(
        _compact_hidden_and_residual)
    for layer in layers[EVICTION_LAYER + 1:]:
        layer.register_forward_pre_hook(_compact_positions)
