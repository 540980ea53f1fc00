"""Recording FOCUS's importance signal under any policy (the decodability study).

While recording, every step's forward also computes, before the attention of layers 0
and 1, the importance (``attention/importance.py``) of each request's masked block
positions, and the runner appends one record per request and step: the absolute
positions, the importance delta I1 - I0, the raw layer-1 importance, and which of the
positions the policy decoded. The policy's own hooks run unchanged after it.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_diffusion.attention.importance import step_candidate_importance
from vllm_diffusion.policies.base import (ForwardStep, LayerHooks, LayerInput, RowSelection,
                                          StepHooks)
from vllm_diffusion.worker.request_state import DiffusionRequest

RECORDED_LAYERS = (0, 1)


class RecordingHooks(StepHooks):
    def __init__(self, step: ForwardStep, inner: StepHooks | None, mask_token_id: int) -> None:
        self.inner = inner
        declared = inner.layers if inner is not None else LayerHooks()
        self.layers = dataclasses.replace(
            declared, before_attention=tuple(sorted(set(declared.before_attention)
                                                    | set(RECORDED_LAYERS))))
        # req_id -> the request's index among the recorded ones
        self.index = {s.request.req_id: i for i, s in enumerate(
            s for s in step.requests if s.request is not None)}
        self.candidate_rows = [s.masked_rows(mask_token_id) for s in step.requests
                               if s.request is not None]
        self.device = step.device
        self.importance: dict[int, list[torch.Tensor | None]] = {}

    def before_attention(self, layer_input: LayerInput) -> RowSelection | None:
        if layer_input.layer in RECORDED_LAYERS:
            rows = [layer_input.current_rows(r).to(self.device) for r in self.candidate_rows]
            self.importance[layer_input.layer] = step_candidate_importance(
                layer_input.query, layer_input.key, rows, layer_input.scale,
                [3] * len(rows))
        if self.inner is not None and layer_input.layer in self.inner.layers.before_attention:
            return self.inner.before_attention(layer_input)
        return None

    def after_output(self, layer_input: LayerInput) -> RowSelection | None:
        return self.inner.after_output(layer_input)

    def select_keys(self, layer_input: LayerInput):
        return self.inner.select_keys(layer_input)

    def scores(self, request: DiffusionRequest) -> tuple[torch.Tensor, torch.Tensor] | None:
        index = self.index.get(request.req_id)
        if index is None or len(self.importance) < len(RECORDED_LAYERS):
            return None
        first, second = (self.importance[layer][index] for layer in RECORDED_LAYERS)
        if second is None:
            return None
        return (second - first).cpu(), second.cpu()


class ImportanceRecorder:
    def __init__(self, mask_token_id: int) -> None:
        self.mask_token_id = mask_token_id
        self.records: list[dict[str, list]] = []
        self.current: RecordingHooks | None = None

    def hooks(self, step: ForwardStep, inner: StepHooks | None) -> RecordingHooks:
        self.current = RecordingHooks(step, inner, self.mask_token_id)
        return self.current

    def record(self, request: DiffusionRequest, masked: torch.Tensor,
               commit: torch.Tensor) -> None:
        """masked: [B] bool before the step's commit; commit: [B] bool."""
        scores = self.current.scores(request) if self.current is not None else None
        if scores is None:
            return
        delta, layer1 = scores
        self.records.append({
            "req_id": request.req_id,
            "positions": (request.canvas.start + torch.nonzero(masked).flatten()).tolist(),
            "delta": delta.tolist(), "layer1": layer1.tolist(),
            "decoded": commit[masked].tolist()})
