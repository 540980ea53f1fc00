"""Recording FOCUS's importance signal under any policy (the decodability study).

``RecordingPolicy`` wraps the engine's policy and delegates the whole policy interface to
it. Its forward hooks also compute, before the attention of layers 0 and 1, the importance
(``vllm_diffusion.kernels.importance``) of each request's masked block positions, and its
decision (``decide``, the inner policy's) appends one record per request and step: the absolute positions, the
importance delta I1 - I0, the raw layer-1 importance, and which of the positions the
wrapped policy decoded. The wrapped policy's own hooks run unchanged after the recording.

The serving package knows nothing of it: ``start_importance_recording(llm)`` swaps the
worker's policy for the wrapper through ``LLM.collective_rpc``, and
``take_importance_records(llm)`` puts the wrapped policy back and returns the records.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_diffusion.attention.importance import step_candidate_importance
from vllm_diffusion.capabilities import PolicyTraits
from vllm_diffusion.policies.base import BlockStart, DecodingPolicy
from vllm_diffusion.step.hooks import (ForwardStep, LayerHooks, LayerInput, RowSelection,
                                       StepHooks)
from vllm_diffusion.step.plans import BlockStepPlan, StepBlocks, StepDecision
from vllm_diffusion.step.request import DiffusionRequest

RECORDED_LAYERS = (0, 1)
POOL_KERNEL = 3


class RecordingHooks(StepHooks):
    """A step's hooks: the importance of layers 0 and 1 first, then the inner policy's."""

    def __init__(self, step: ForwardStep, inner: StepHooks | None, mask_token_id: int) -> None:
        self.inner = inner
        declared = inner.layers if inner is not None else LayerHooks()
        self.layers = dataclasses.replace(
            declared, before_attention=tuple(sorted(set(declared.before_attention)
                                                    | set(RECORDED_LAYERS))))
        # req_id -> the request's index among the recorded ones
        self.index = {s.request.req_id: i for i, s in enumerate(
            s for s in step.requests if s.request is not None)}
        # each recorded request's candidates: their step rows and the block positions
        # they decode, in row order (where logits are shifted, a candidate's row is the
        # one before its position)
        self.candidate_rows, self.candidate_positions = [], []
        for s in step.requests:
            if s.request is not None:
                masked = s.request.canvas.masked(mask_token_id)[s.block_positions]
                self.candidate_rows.append(s.block_rows[masked])
                self.candidate_positions.append(s.block_positions[masked])
        self.device = step.device
        self.importance: dict[int, list[torch.Tensor | None]] = {}

    def before_attention(self, layer_input: LayerInput) -> RowSelection | None:
        if layer_input.layer in RECORDED_LAYERS:
            rows = [layer_input.current_rows(r).to(self.device) for r in self.candidate_rows]
            self.importance[layer_input.layer] = step_candidate_importance(
                layer_input.query, layer_input.key, rows, layer_input.scale,
                [POOL_KERNEL] * len(rows))
        if self.inner is not None and layer_input.layer in self.inner.layers.before_attention:
            return self.inner.before_attention(layer_input)
        return None

    def after_output(self, layer_input: LayerInput) -> RowSelection | None:
        return self.inner.after_output(layer_input) if self.inner is not None else None

    def select_keys(self, layer_input: LayerInput):
        return self.inner.select_keys(layer_input) if self.inner is not None else None

    def preselected_keys(self, layer: int):
        return self.inner.preselected_keys(layer) if self.inner is not None else None

    def after_key_scoring(self, layer: int, selected) -> None:
        if self.inner is not None:
            self.inner.after_key_scoring(layer, selected)

    def scores(self, request: DiffusionRequest
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(block positions, I1 - I0, I1) of the request's computed masked positions, or
        None if not recorded."""
        index = self.index.get(request.req_id)
        if index is None or len(self.importance) < len(RECORDED_LAYERS):
            return None
        first, second = (self.importance[layer][index] for layer in RECORDED_LAYERS)
        if second is None:
            return None
        return self.candidate_positions[index], (second - first).cpu(), second.cpu()


class RecordingPolicy(DecodingPolicy):
    """The policy ``inner`` with importance recording; every decision is the inner's."""

    def __init__(self, inner: DecodingPolicy) -> None:  # noqa: D107 - no base __init__:
        # the engine attributes are the inner policy's (properties below)
        self.inner = inner
        self.records: list[dict[str, list]] = []
        self.current: RecordingHooks | None = None

    # The attributes of the interface, read from the inner policy.
    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def config_cls(self) -> type:
        return self.inner.config_cls

    @property
    def confidence_rule(self) -> str:
        return self.inner.confidence_rule

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def mask_token_id(self) -> int:
        return self.inner.mask_token_id

    @property
    def engine_config(self) -> Any:
        return self.inner.engine_config

    def __getattr__(self, attribute: str) -> Any:
        # Anything else a caller reads (a policy's own attributes) is the inner's.
        if attribute == "inner":
            raise AttributeError(attribute)
        return getattr(self.inner, attribute)

    # The interface's methods: the inner's, with recording added at the hooks and the
    # decision.
    @property
    def model(self) -> Any:
        return self.inner.model

    @property
    def proposal_ranks(self) -> int:
        return self.inner.proposal_ranks

    def bind(self, model: Any, hf_config: Any, prefix_caching: bool) -> None:
        self.inner.bind(model, hf_config, prefix_caching)

    def begin_step(self, requests: list[DiffusionRequest]) -> None:
        self.inner.begin_step(requests)

    def new_state(self, config: Any) -> Any:
        return self.inner.new_state(config)

    def plan_step(self, request: DiffusionRequest, start: BlockStart) -> BlockStepPlan:
        return self.inner.plan_step(request, start)

    def forward_hooks(self, step: ForwardStep) -> RecordingHooks:
        self.current = RecordingHooks(step, self.inner.forward_hooks(step), self.mask_token_id)
        return self.current

    def decide(self, blocks: StepBlocks) -> StepDecision:
        decision = self.inner.decide(blocks)
        for request, commit in zip(blocks.requests, decision.commits):
            self.record(request, commit)
        return decision

    @classmethod
    def traits(cls, options: Any) -> PolicyTraits:
        return PolicyTraits(partial_blocks="importance recording studies decoding on fixed "
                            "positions with whole-block forwards only")

    def after_step(self, request: DiffusionRequest, masked_before: torch.Tensor,
                   computed: torch.Tensor, num_decoded: int, block_done: bool) -> None:
        self.inner.after_step(request, masked_before, computed, num_decoded, block_done)

    def counters(self) -> dict[str, Any]:
        return self.inner.counters()

    def record(self, request: DiffusionRequest, commit: torch.Tensor) -> None:
        """One record of the request's step; ``commit``: [B] bool, its chosen positions
        (the canvas is not yet updated, so its masked positions are those of the step)."""
        scores = self.current.scores(request) if self.current is not None else None
        if scores is None:
            return
        positions, delta, layer1 = scores
        self.records.append({
            "req_id": request.req_id,
            "positions": (request.canvas.start + positions).tolist(),
            "delta": delta.tolist(), "layer1": layer1.tolist(),
            "decoded": commit[positions].tolist()})


def wrap_worker_policy(worker: Any) -> None:
    """On a worker: record under its policy from now on (a no-op if already recording)."""
    runner = worker.model_runner
    if not isinstance(runner.policy, RecordingPolicy):
        runner.policy = RecordingPolicy(runner.policy)


def unwrap_worker_policy(worker: Any) -> list[dict[str, list]]:
    """On a worker: put the wrapped policy back; the records since wrapping."""
    runner = worker.model_runner
    if not isinstance(runner.policy, RecordingPolicy):
        return []
    recording, runner.policy = runner.policy, runner.policy.inner
    return recording.records


def start_importance_recording(llm: Any) -> None:
    """Record FOCUS importance (layers 0/1) of masked positions at every step of ``llm``
    (a ``vllm.LLM`` serving a diffusion model) until ``take_importance_records``."""
    llm.collective_rpc(wrap_worker_policy)


def take_importance_records(llm: Any) -> list[dict[str, list]]:
    """The records (first worker's) since ``start_importance_recording``; recording stops."""
    return llm.collective_rpc(unwrap_worker_policy)[0]
