"""What the ``elastic`` policy knows about chunk sizes: output tokens committed and block
rows computed per request-step, per chunk size and decoding stage. A step that computed a
window of c_a undecided positions shows what every smaller window would have done (its
commits among the first c undecided positions, at least one, and its computed positions
there): ``window_outcomes`` counts both for every candidate size up to c_a at once.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from vllm_diffusion.step.request import OutputBounds

MIN_OBSERVATIONS = 8


def chunk_candidates(block_size: int) -> list[int]:
    """1, 2, 3, 4, then sizes about 1.5 apart (6, 8, 12, 16, 24, ...) up to the block, and
    the block (with every size 1..B the noisiest estimate would win the argmax)."""
    sizes, size = {1, 2, 3, 4, block_size}, 4
    while size < block_size:
        for step in (size * 3 // 2, size * 2):
            if step < block_size:
                sizes.add(step)
        size *= 2
    return sorted(s for s in sizes if s <= block_size)


STAGES = 4  # decoding stages: quarters of the block still masked before the step


def nondecreasing(values: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit of ``values`` (pooled adjacent
    violators)."""
    pools: list[list[float]] = []  # [weighted sum, weight, count]
    for value, weight in zip(values, weights):
        pools.append([value * weight, weight, 1])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            last = pools.pop()
            pools[-1] = [pools[-1][0] + last[0], pools[-1][1] + last[1], pools[-1][2] + last[2]]
    return [total / weight for total, weight, count in pools for _ in range(int(count))]


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

    def observe(self, chunk: int, stage: int, committed: float, rows: float,
                steps: int = 1) -> None:
        """``steps`` request-steps at ``chunk`` in ``stage`` with these totals."""
        for key in ((chunk, stage), chunk):
            self.steps[key] += steps
            self.commits[key] += committed
            self.rows[key] += rows

    def learn(self, records: list[StepRecord], candidates: list[int], block_size: int,
              mask_token_id: int) -> None:
        """Every candidate size each record's window shows (``window_outcomes``)."""
        if records:
            for (chunk, stage), totals in window_outcomes(records, candidates, block_size,
                                                          mask_token_id).items():
                self.observe(chunk, stage, totals[1], totals[2], steps=totals[0])

    def _mean(self, key) -> tuple[float, float]:
        return self.commits[key] / self.steps[key], self.rows[key] / self.steps[key]

    def stage_factors(self, stage: int, observed: list[int]) -> tuple[float, float]:
        """(commits, rows) of the request-steps seen at ``stage`` relative to what their
        sizes' means over all stages predict, over the observed sizes with enough steps
        at that stage (1, 1 when none has)."""
        steps = commits = rows = expected_commits = expected_rows = 0.0
        for chunk in observed:
            key = (chunk, stage)
            if self.steps[key] >= 2 * MIN_OBSERVATIONS:
                mean_commits, mean_rows = self._mean(chunk)
                steps += self.steps[key]
                commits, rows = commits + self.commits[key], rows + self.rows[key]
                expected_commits += self.steps[key] * mean_commits
                expected_rows += self.steps[key] * mean_rows
        if not steps or not expected_commits or not expected_rows:
            return 1.0, 1.0
        return commits / expected_commits, rows / expected_rows

    def estimates(self, stage: int, candidates: list[int], block_size: int
                  ) -> dict[int, tuple[float, float]]:
        """(commits, rows) per request-step at each candidate size in ``stage``: its mean
        at the stage if seen often enough there, else its mean over all stages scaled by
        ``stage_factors``, else interpolated linearly between the nearest such sizes, else
        guessed from the whole block (commits N(B) * (c/B)^0.5, rows c + rows(B) - B);
        commits then made non-decreasing in the size (weighted by observations)."""
        observed = self.observed_sizes(block_size)
        factors = self.stage_factors(stage, observed)
        known: dict[int, tuple[float, float]] = {}
        for chunk in observed:
            if self.steps[(chunk, stage)] >= 2 * MIN_OBSERVATIONS:
                known[chunk] = self._mean((chunk, stage))
            else:
                commits, rows = self._mean(chunk)
                known[chunk] = (min(commits * factors[0], chunk), rows * factors[1])
        whole = known.get(block_size) or (
            self._mean(block_size) if self.steps[block_size] else (1.0, block_size))
        found = {}
        for chunk in candidates:
            below = [c for c in known if c <= chunk]
            above = [c for c in known if c >= chunk]
            if below and above:
                low, high = max(below), min(above)
                weight = 0.0 if high == low else (chunk - low) / (high - low)
                (c0, r0), (c1, r1) = known[low], known[high]
                found[chunk] = (c0 + weight * (c1 - c0), r0 + weight * (r1 - r0))
            else:
                found[chunk] = (max(whole[0] * (chunk / block_size) ** 0.5, 1.0),
                                max(chunk + whole[1] - block_size, chunk))
        commits = nondecreasing([found[c][0] for c in candidates],
                                [self.steps[c] + 1 for c in candidates])
        return {c: (m, found[c][1]) for c, m in zip(candidates, commits)}

    def observed_sizes(self, block_size: int) -> list[int]:
        return [c for c in range(1, block_size + 1) if self.steps[c] >= MIN_OBSERVATIONS]

    def observed_steps(self, chunk: int) -> int:
        return self.steps[chunk]


@dataclasses.dataclass
class StepRecord:
    """One request-step as the statistics need it."""

    masked: torch.Tensor  # [B] bool: undecided before the step
    tokens: torch.Tensor  # [B] int64: the block after the step (a copy)
    computed: torch.Tensor  # [B] bool: positions the step computed
    start: int  # the block's absolute position
    bounds: OutputBounds  # where the request's output can end
    chunk: int  # the window's size (B: the whole block)
    reuse: bool


def output_masks(records: list[StepRecord]) -> torch.Tensor:
    """[R, B] bool: each block's positions that can become output (``OutputBounds``, for
    all records at once: one pass per distinct set of stop tokens)."""
    tokens = torch.stack([r.tokens for r in records])
    width = tokens.shape[1]
    limit = torch.tensor([width if r.bounds.end is None else max(r.bounds.end - r.start, 0)
                          for r in records])
    by_stops: dict[frozenset, list[int]] = collections.defaultdict(list)
    for i, r in enumerate(records):
        if r.bounds.stop_token_ids:
            by_stops[r.bounds.stop_token_ids].append(i)
    for stops, rows in by_stops.items():
        index = torch.tensor(rows)
        is_stop = torch.isin(tokens[index], torch.tensor(sorted(stops)))
        first = torch.where(is_stop.any(dim=1), is_stop.to(torch.int8).argmax(dim=1) + 1,
                            width)
        limit[index] = torch.minimum(limit[index], first)
    return torch.arange(width) < limit[:, None]


def window_outcomes(records: list[StepRecord], candidates: list[int], block_size: int,
                    mask_token_id: int) -> dict[tuple[int, int], tuple[int, float, float]]:
    """(chunk, stage) -> (request-steps, output commits, rows) that the records' windows
    show for each candidate chunk no larger than the window each request computed."""
    masked = torch.stack([r.masked for r in records])  # [R, B]
    output = output_masks(records)
    committed = masked & (torch.stack([r.tokens for r in records]) != mask_token_id)
    useful = committed & output
    reachable = masked & output
    computed = torch.stack([r.computed for r in records])
    sizes = torch.tensor(candidates)  # [K]
    undecided = masked.sum(dim=1)  # [R]
    before = (masked.long().cumsum(dim=1) - masked.long())  # [R, B] undecided left of it
    # [R, B, K]: position in the window of a chunk of each size
    window = (before[..., None] < sizes) | (undecided[:, None, None] <= sizes)
    commits = (useful[..., None] & window).sum(dim=1)  # [R, K]
    any_reachable = (reachable[..., None] & window).any(dim=1)
    commits = torch.maximum(commits, any_reachable.long())  # at least one commit
    reuse = torch.tensor([r.reuse for r in records])[:, None, None]
    rows = torch.where(reuse, (masked | computed)[..., None] & window, window).sum(dim=1)
    valid = sizes <= torch.tensor([r.chunk for r in records])[:, None]  # [R, K]
    stages = torch.clamp((block_size - undecided) * STAGES // block_size,
                         max=STAGES - 1)  # stage_of, for all at once
    outcomes = {}
    for stage in stages.unique().tolist():
        rows_of = valid & (stages == stage)[:, None]
        steps = rows_of.sum(dim=0).tolist()
        total_commits = (commits * rows_of).sum(dim=0).tolist()
        total_rows = (rows * rows_of).sum(dim=0).tolist()
        for k, chunk in enumerate(candidates):
            if steps[k]:
                outcomes[(chunk, stage)] = (steps[k], total_commits[k], total_rows[k])
    return outcomes
