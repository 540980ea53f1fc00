"""Elastic chunked decoding (Optimus, section 5): the chunk size chosen at every step,
with a latency model the engine learns from its own steps.

Each step, for the b requests scheduled, the policy picks

    c* = argmax over c in C of  sum_i N_commit(c, stage_i) / T(sum_i rows(c, stage_i))

over the chunk sizes C (``chunk_candidates``: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ... up
to B, not only powers of two), keeping the current size unless another promises 5% more
(``SWITCH_MARGIN``), where

- T(x) is the step latency for x block rows, learned online (``OnlineLatency``): each
  engine step's wall time (from its start to the next step's start) against the block
  rows it computed, refitted over a rolling window, its error measured on held-out steps;
  the same row definition is used to fit and to query. A saved profile
  (``latency_profile``, made by ``tools/profile_latency.py``) may warm-start it; none is
  needed: until the first fit (8 steps) the policy decodes whole blocks;
- N_commit(c, stage) and rows(c, stage) are the mean tokens committed and block rows
  computed per request-step at chunk c, observed since start-up and kept per decoding
  stage (the quarter of the block still masked before the step), so the estimate follows
  the stage: early steps commit less than late ones. A size or stage with too few
  observations borrows the size's other stages, then interpolates between the nearest
  observed sizes (linear in c), then guesses from the whole block (commits N(B) * (c/B)^0.5,
  rows c + rows(B) - B).

c counts the undecided positions a step computes per request (the chunk window of
``chunk_window.py``: the first c undecided positions, with decoded ones left of them as
context; with ``chunk_reuse``, the default here as in the paper's prefix caching, those
keep their KV, so a request computes about c positions). Every ``explore_every``-th step
one request (in turn) decodes at the least observed size, so every estimate keeps being
measured without moving the batch off its choice. A request's own ``chunk_size`` overrides
the choice for it. Unmasking is the strategies' (``unmasking.py``); committed KV is exact
whatever the chunk.

Remaining deviations: the paper profiles T offline per model and GPU; here it is learned
in service (a profile is optional). The paper's exploration is not specified; ours is one
request per ``explore_every`` steps. Token editing is refused (a chunk leaves positions
without a new proposal).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, ClassVar

import torch

from vllm_diffusion.options import Rule, option
from vllm_diffusion.policies.chunk_window import ChunkConfig, ChunkWindow
from vllm_diffusion.policies.latency_model import LatencyProfile, OnlineLatency, model_identity
from vllm_diffusion.policies.unmasking import StrategyPolicy
from vllm_diffusion.step.plans import BlockStepPlan
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


ElasticRequest = DiffusionRequest[ElasticConfig, ChunkWindow]

MIN_OBSERVATIONS = 8
SWITCH_MARGIN = 1.05  # another size must promise 5% more commits per second to be taken


def chunk_candidates(block_size: int) -> list[int]:
    """The chunk sizes the policy chooses among: 1, 2, 3, 4, then every size a factor of
    about 1.5 apart (6, 8, 12, 16, 24, 32, 48, ...) up to the block, and the block: finer
    than powers of two, coarse enough that each size is observed often (with every size
    1..B the noisiest estimate wins the argmax)."""
    sizes, size = {1, 2, 3, 4, block_size}, 4
    while size < block_size:
        for step in (size * 3 // 2, size * 2):
            if step < block_size:
                sizes.add(step)
        size *= 2
    return sorted(s for s in sizes if s <= block_size)
STAGES = 4  # decoding stages: quarters of the block still masked before the step


def stage_of(masked: int, block_size: int) -> int:
    """The decoding stage of a block with ``masked`` undecided positions (0: mostly
    masked, STAGES - 1: nearly done)."""
    return min(STAGES - 1, (block_size - masked) * STAGES // block_size)


class ChunkStatistics:
    """Request-steps observed at each (chunk size, stage): commits and rows."""

    def __init__(self) -> None:
        self.steps: collections.Counter = collections.Counter()
        self.commits: collections.Counter = collections.Counter()
        self.rows: collections.Counter = collections.Counter()

    def observe(self, chunk: int, stage: int, committed: int, rows: int) -> None:
        for key in ((chunk, stage), chunk):
            self.steps[key] += 1
            self.commits[key] += committed
            self.rows[key] += rows

    def _mean(self, key) -> tuple[float, float]:
        return self.commits[key] / self.steps[key], self.rows[key] / self.steps[key]

    def estimate(self, chunk: int, stage: int, block_size: int,
                 observed: list[int] | None = None) -> tuple[float, float]:
        """(commits, rows) per request-step at ``chunk`` in ``stage``; ``observed``: the
        sizes with enough observations (``observed_sizes``), when the caller has them."""
        for key in ((chunk, stage), chunk):
            if self.steps[key] >= MIN_OBSERVATIONS * (2 if isinstance(key, tuple) else 1):
                return self._mean(key)
        if observed is None:
            observed = self.observed_sizes(block_size)
        below = [c for c in observed if c < chunk]
        above = [c for c in observed if c > chunk]
        if below and above:
            low, high = below[-1], above[0]
            weight = (chunk - low) / (high - low)
            (c0, r0), (c1, r1) = self._mean(low), self._mean(high)
            return c0 + weight * (c1 - c0), r0 + weight * (r1 - r0)
        whole = self._mean(block_size) if self.steps[block_size] else (1.0, block_size)
        return (max(whole[0] * (chunk / block_size) ** 0.5, 1.0),
                max(chunk + whole[1] - block_size, chunk))

    def observed_sizes(self, block_size: int) -> list[int]:
        return [c for c in range(1, block_size + 1) if self.steps[c] >= MIN_OBSERVATIONS]

    def observed_steps(self, chunk: int) -> int:
        return self.steps[chunk]


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
        self.step_rows = 0  # block rows of the step under way

    def bind_model(self, hf_config: Any, prefix_caching: bool) -> None:
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
        """c* for a step of ``requests``, from the estimates so far (computed once per
        size and stage, weighted by the requests in each stage)."""
        per_stage = collections.Counter(
            stage_of(int(r.canvas.masked(self.mask_token_id).sum()), self.block_size)
            if r.canvas is not None else 0 for r in requests)
        observed = self.statistics.observed_sizes(self.block_size)

        def rate(chunk: int) -> float:
            commits = rows = 0.0
            for stage, count in per_stage.items():
                c, r = self.statistics.estimate(chunk, stage, self.block_size, observed)
                commits, rows = commits + count * c, rows + count * r
            return commits / self.latency.seconds(rows)

        rates = {c: rate(c) for c in self.candidates}
        best = max(rates, key=rates.get)
        if self.step_chunk in rates and rates[best] < SWITCH_MARGIN * rates[self.step_chunk]:
            return self.step_chunk  # keep the current size unless clearly beaten
        return best

    def start_block(self, request: ElasticRequest, resumed: bool) -> None:
        request.policy_state.start_block()

    def plan_step(self, request: ElasticRequest) -> BlockStepPlan:
        chunk = (request.policy_config.chunk_size or self.explored.get(request.req_id)
                 or self.step_chunk)
        return request.policy_state.plan(request.canvas, self.mask_token_id,
                                         None if chunk >= self.block_size else chunk,
                                         request.policy_config.chunk_reuse)

    def after_step(self, request: ElasticRequest, masked_before: torch.Tensor,
                   computed: torch.Tensor, num_decoded: int) -> None:
        state = request.policy_state
        state.after_step(masked_before, computed, request.policy_config.chunk_reuse)
        rows = int(computed.sum())
        self.step_rows += rows
        self.statistics.observe(state.chunk or self.block_size,
                                stage_of(int(masked_before.sum()), self.block_size),
                                num_decoded, rows)

    def chosen_chunk(self) -> int | None:
        return self.step_chunk

    def counters(self) -> dict[str, Any]:
        return {"elastic_chunk_steps": dict(sorted(self.chosen.items())),
                "latency_observations": self.latency.observed if self.latency else 0,
                "latency_held_out_error": (self.latency.held_out_error()
                                           if self.latency else None)}
