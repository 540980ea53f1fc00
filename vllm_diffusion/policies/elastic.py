"""Elastic chunked decoding (Optimus, section 5): the chunk size chosen at every step.

Each step, for the b requests scheduled, the policy picks

    c* = argmax over c in C of  N_commit(c) * b / T(rows(c) * b)

where C holds the block size and its power-of-two divisors, T is the machine's step
latency for a number of rows (``latency_model.LatencyProfile``, measured offline by
``tools/profile_latency.py`` and loaded at start-up), and two online estimates come from
the steps observed so far at each chunk size (over all requests, since start-up):

- N_commit(c): mean tokens committed per request and step;
- rows(c): mean rows computed per request and step (the chunk, its context and commits).

Estimator (the paper leaves it open): the first ``warmup_steps`` steps use c = B; a chunk
size with fewer than ``min_observations`` observed request-steps is estimated from c = B
as N(B) * (c / B) ** 0.5 commits (a concave guess: commits grow with the window but with
diminishing returns) and c + (rows(B) - B) rows. Every ``explore_every``-th step tries
the least observed size, so every estimate keeps being measured. A request's own
``chunk_size`` overrides the choice for it. Unmasking is the strategies'
(``unmasking.py``), chunk windows the chunk-window component's (``chunk_window.py``), as
for ``standard``; committed KV is exact whatever the chunk.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, ClassVar

import torch

from vllm_diffusion.options import Rule, option
from vllm_diffusion.policies.chunk_window import ChunkConfig, ChunkWindow
from vllm_diffusion.policies.latency_model import LatencyProfile
from vllm_diffusion.policies.unmasking import StrategyPolicy
from vllm_diffusion.step.plans import BlockStepPlan
from vllm_diffusion.step.request import DiffusionRequest


@dataclasses.dataclass(frozen=True)
class ElasticConfig(ChunkConfig):
    engine_only: ClassVar[tuple[str, ...]] = (*ChunkConfig.engine_only, "latency_profile",
                                              "warmup_steps", "explore_every")

    latency_profile: str | None = option(None, Rule(str, optional=True))
    chunk_reuse: bool = option(True, Rule(bool))  # the paper's prefix caching
    warmup_steps: int = option(4, Rule(int, low=0, high=10_000))
    explore_every: int = option(16, Rule(int, low=2, high=10_000))

    def validate_for_block(self, block_size: int, source: str) -> None:
        super().validate_for_block(block_size, source)
        self.refuse_editing_with(source, "with the elastic policy (its chunks leave positions "
                                         "without a new proposal)")


ElasticRequest = DiffusionRequest[ElasticConfig, ChunkWindow]

MIN_OBSERVATIONS = 8


class ChunkStatistics:
    """Request-steps observed at each chunk size: commits and rows."""

    def __init__(self) -> None:
        self.steps: collections.Counter = collections.Counter()
        self.commits: collections.Counter = collections.Counter()
        self.rows: collections.Counter = collections.Counter()

    def observe(self, chunk: int, committed: int, rows: int) -> None:
        self.steps[chunk] += 1
        self.commits[chunk] += committed
        self.rows[chunk] += rows

    def estimate(self, chunk: int, block_size: int) -> tuple[float, float]:
        """(commits, rows) per request and step at ``chunk``."""
        if self.steps[chunk] >= MIN_OBSERVATIONS:
            return (self.commits[chunk] / self.steps[chunk],
                    self.rows[chunk] / self.steps[chunk])
        whole_steps = max(self.steps[block_size], 1)
        commits = self.commits[block_size] / whole_steps if self.steps[block_size] else 1.0
        rows = self.rows[block_size] / whole_steps if self.steps[block_size] else block_size
        return (max(commits * (chunk / block_size) ** 0.5, 1.0),
                max(chunk + rows - block_size, chunk))


class ElasticPolicy(StrategyPolicy[ElasticConfig, ChunkWindow]):
    name: ClassVar[str] = "elastic"
    config_cls: ClassVar[type] = ElasticConfig

    def __init__(self, block_size: int, mask_token_id: int,
                 engine_config: ElasticConfig) -> None:
        super().__init__(block_size, mask_token_id, engine_config)
        self.candidates = [c for c in range(1, block_size + 1) if block_size % c == 0
                           and (c & (c - 1) == 0 or c == block_size)]
        self.profile: LatencyProfile | None = None
        self.statistics = ChunkStatistics()
        self.steps_begun = 0
        self.step_chunk = block_size

    def bind_model(self, hf_config: Any, prefix_caching: bool) -> None:
        path = self.engine_config.latency_profile
        if path is None:
            raise ValueError("the elastic policy needs option 'latency_profile': a file made "
                             "by tools/profile_latency.py for this model on this machine")
        self.profile = LatencyProfile.load(path, hf_config)

    def new_state(self, config: ElasticConfig) -> ChunkWindow:
        return ChunkWindow(self.block_size)

    def begin_step(self, requests: list[ElasticRequest]) -> None:
        self.steps_begun += 1
        config = self.engine_config
        if not requests or self.steps_begun <= config.warmup_steps:
            self.step_chunk = self.block_size
        elif self.steps_begun % config.explore_every == 0:
            self.step_chunk = min(self.candidates, key=lambda c: (self.statistics.steps[c], -c))
        else:
            self.step_chunk = self.choose_chunk(len(requests))

    def choose_chunk(self, batch: int) -> int:
        """c* for a step of ``batch`` requests, from the estimates so far."""

        def rate(chunk: int) -> float:
            commits, rows = self.statistics.estimate(chunk, self.block_size)
            return commits * batch / self.profile.seconds(rows * batch)

        return max(self.candidates, key=rate)

    def start_block(self, request: ElasticRequest, resumed: bool) -> None:
        request.policy_state.start_block()

    def plan_step(self, request: ElasticRequest) -> BlockStepPlan:
        chunk = request.policy_config.chunk_size or self.step_chunk
        return request.policy_state.plan(request.canvas, self.mask_token_id,
                                         None if chunk >= self.block_size else chunk,
                                         request.policy_config.chunk_reuse)

    def after_step(self, request: ElasticRequest, masked_before: torch.Tensor,
                   computed: torch.Tensor, num_decoded: int) -> None:
        state = request.policy_state
        state.after_step(masked_before, computed, request.policy_config.chunk_reuse)
        self.statistics.observe(state.chunk or self.block_size, num_decoded,
                                int(computed.sum()))
