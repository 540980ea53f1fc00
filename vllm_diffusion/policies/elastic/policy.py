"""Elastic chunked decoding (Optimus, section 5): ``ElasticPolicy`` chooses the chunk
size at every step as the c maximising the batch's expected commits per second,
sum_i N_commit(min(c, U_i), stage_i) / T(sum_i rows(min(c, U_i), stage_i)) (U_i: block
i's undecided positions), from the statistics of ``chunk_statistics.py`` and the latency
model of ``latency_model.py``, both learned from the engine's own steps. The window is
``parts/chunk_window.py``'s; unmasking is the rules'. Why T is queried with the commits,
what is counted, exploration, pinning and the deviations: docs/policies.md, "elastic".
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from vllm_diffusion.capabilities import ModelCapabilities, PolicyTraits
from vllm_diffusion.options import Rule, option
from vllm_diffusion.policies.elastic.chunk_statistics import (
    ChunkStatistics,
    StepRecord,
    chunk_candidates,
    stage_of,
)
from vllm_diffusion.policies.base import BlockStart
from vllm_diffusion.policies.parts.chunk_window import ChunkConfig, ChunkWindow
from vllm_diffusion.policies.elastic.latency_model import (LatencyProfile, OnlineLatency,
                                                           model_identity)
from vllm_diffusion.policies.parts.strategy_unmasking import StrategyPolicy
from vllm_diffusion.step.hooks import ForwardStep
from vllm_diffusion.step.plans import BlockStepPlan, StepBlocks, StepDecision
from vllm_diffusion.step.request import DiffusionRequest


@dataclasses.dataclass(frozen=True)
class ElasticConfig(ChunkConfig):
    engine_only: ClassVar[tuple[str, ...]] = (*ChunkConfig.engine_only, "latency_profile",
                                              "warmup_steps", "explore_every")

    # a profile from tools/profile_latency.py to start from (None: learned from the steps)
    latency_profile: str | None = option(None, Rule(str, optional=True))
    chunk_reuse: bool = option(True, Rule(bool))  # the paper's prefix caching
    warmup_steps: int = option(8, Rule(int, low=0, high=10_000))
    explore_every: int = option(8, Rule(int, low=2, high=10_000))

    def validate_for_block(self, block_size: int, source: str) -> None:
        super().validate_for_block(block_size, source)
        self.refuse_editing_with(source, "with the elastic policy (its chunks leave positions "
                                         "without a new proposal)")

    @classmethod
    def traits(cls, options: Mapping[str, Any]) -> PolicyTraits:
        """Computes a chunk of the block; where logits are shifted, its window of rows
        reads every undecided position in it (``parts/chunk_window.py``)."""
        return dataclasses.replace(super().traits(options), shifted_logits=True,
                                   shifted_partial_blocks=True)


ElasticRequest = DiffusionRequest[ElasticConfig, ChunkWindow]

SWITCH_MARGIN = 1.05  # another size must promise 5% more commits per second to be taken
LEARN_EVERY = 8  # steps between updates of the statistics (and of the estimates)


class ElasticPolicy(StrategyPolicy[ElasticConfig, ChunkWindow]):
    name: ClassVar[str] = "elastic"
    config_cls: ClassVar[type] = ElasticConfig

    def __init__(self, block_size: int, mask_token_id: int,
                 engine_config: ElasticConfig) -> None:
        super().__init__(block_size, mask_token_id, engine_config)
        self.candidates = chunk_candidates(block_size)
        self.latency: OnlineLatency | None = None
        self.statistics = ChunkStatistics()
        self.steps_begun = 0
        self.step_chunk = block_size
        self.explored: dict[str, int] = {}  # req_id -> its chunk this step (exploration)
        self.explore_turn = 0
        self.chosen: collections.Counter = collections.Counter()  # steps per chosen chunk
        self.step_started: float | None = None
        self.step_rows = 0  # rows of the step under way (all of them)
        self.records: list[StepRecord] = []  # request-steps since the statistics learned
        self.estimates: dict[int, dict[int, tuple[float, float]]] = {}  # per stage, cached

    def bind(self, model: ModelCapabilities, hf_config: Any, prefix_caching: bool) -> None:
        super().bind(model, hf_config, prefix_caching)
        path = self.engine_config.latency_profile
        warm = LatencyProfile.load(path, hf_config) if path is not None else None
        self.latency = OnlineLatency(model_identity(hf_config), warm_start=warm)

    def new_state(self, config: ElasticConfig) -> ChunkWindow:
        return ChunkWindow(self.block_size)

    def begin_step(self, requests: list[ElasticRequest]) -> None:
        now = time.perf_counter()
        if self.step_started is not None and self.step_rows and requests:
            self.latency.observe(self.step_rows, now - self.step_started)
        self.step_started, self.step_rows = (now if requests else None), 0
        self.steps_begun += 1
        if self.steps_begun % LEARN_EVERY == 0:
            self.statistics.learn(self.records, self.candidates, self.block_size,
                                  self.mask_token_id)
            self.records, self.estimates = [], {}
        self.explored = {}
        config = self.engine_config
        if (not requests or self.steps_begun <= config.warmup_steps
                or not self.latency.ready):
            self.step_chunk = self.block_size
        else:
            self.step_chunk = self.choose_chunk(requests)
            if self.steps_begun % config.explore_every == 0:
                self.explore_turn = (self.explore_turn + 1) % len(requests)
                least = min(self.candidates,
                            key=lambda c: (self.statistics.observed_steps(c), -c))
                self.explored[requests[self.explore_turn].req_id] = least
        if requests:
            self.chosen[self.step_chunk] += 1

    def choose_chunk(self, requests: list[ElasticRequest]) -> int:
        """c* for a step of ``requests``, from the estimates so far (a request with U
        undecided positions computes min(c, U) of them, so its estimate is that size's)."""
        per_block = collections.Counter(self.undecided_counts(requests))
        sizes = list(range(1, self.block_size + 1))
        totals = {c: [0.0, 0.0] for c in self.candidates}  # commits, rows of the step
        for undecided, count in per_block.items():
            stage = stage_of(undecided, self.block_size)
            if stage not in self.estimates:  # until the statistics learn again
                self.estimates[stage] = self.statistics.estimates(stage, sizes,
                                                                  self.block_size)
            for chunk in self.candidates:
                commits, rows = self.estimates[stage][min(chunk, undecided)]
                totals[chunk][0] += count * commits
                totals[chunk][1] += count * rows
        rates = {c: commits / self.latency.seconds(rows + commits)
                 for c, (commits, rows) in totals.items()}
        best = max(rates, key=rates.get)
        if self.step_chunk in rates and rates[best] < SWITCH_MARGIN * rates[self.step_chunk]:
            return self.step_chunk  # keep the current size unless clearly beaten
        return best

    def undecided_counts(self, requests: list[ElasticRequest]) -> list[int]:
        """Undecided positions of the block each request's next step denoises (a done
        canvas: B, its next step starts a new block)."""
        canvases = [r.canvas.tokens for r in requests if r.canvas is not None]
        masked = (torch.stack(canvases) == self.mask_token_id).sum(dim=1).tolist() if (
            canvases) else []
        counts = iter(m or self.block_size for m in masked)
        return [self.block_size if r.canvas is None else next(counts) for r in requests]

    def plan_step(self, request: ElasticRequest, start: BlockStart) -> BlockStepPlan:
        if start is not None:
            request.policy_state.start_block()
        # a request's own chunk_size pins its chunk (its output then ignores the load)
        chunk = (request.policy_config.chunk_size or self.explored.get(request.req_id)
                 or self.step_chunk)
        return request.policy_state.plan(request.canvas, self.mask_token_id,
                                         None if chunk >= self.block_size else chunk,
                                         request.policy_config.chunk_reuse)

    def forward_hooks(self, step: ForwardStep) -> None:
        """No hooks; notes the step's rows (all of them) for the latency model."""
        self.step_rows = step.num_rows
        return None

    def decide(self, blocks: StepBlocks) -> StepDecision:
        return dataclasses.replace(super().decide(blocks), chunk=self.step_chunk)

    def after_step(self, request: ElasticRequest, masked_before: torch.Tensor,
                   computed: torch.Tensor, num_decoded: int, block_done: bool) -> None:
        state = request.policy_state
        state.after_step(masked_before, computed, request.policy_config.chunk_reuse,
                         self.model.shifted_logits)
        canvas = request.canvas
        self.records.append(StepRecord(masked_before, canvas.tokens.clone(), computed,
                                       canvas.start, request.bounds,
                                       state.chunk or self.block_size,
                                       request.policy_config.chunk_reuse))

    def counters(self) -> dict[str, Any]:
        return {"elastic_chunk_steps": dict(sorted(self.chosen.items())),
                "latency_observations": self.latency.observed if self.latency else 0,
                "latency_held_out_error": (self.latency.held_out_error()
                                           if self.latency else None)}
