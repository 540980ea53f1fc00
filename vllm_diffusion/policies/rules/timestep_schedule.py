"""The ``timestep_schedule`` strategy: Dream's ``diffusion_generate``. Block step s unmasks
``int(M * (1 - t_{s+1} / t_s))`` of its M masks (timesteps ``linspace(1, eps, steps + 1)``,
float32 as the published loop: the truncation decides the count), every one left at its
last step; a step whose count is 0 commits nothing by design (``TimestepSchedule.idle``).
The top count by ``alg`` are unmasked, ties to the lower position (the published
``torch.topk`` leaves their order unspecified); ``maskgit_plus``'s probability is the
engine's confidence (the argmax's when greedy, the drawn token's when sampled).
"""

from __future__ import annotations

import functools

import torch

from vllm_diffusion.policies.rules.blocks import CommitRule, RuleBlocks, rank_by_score

# the published ``alg`` values the strategy ranks by
SCHEDULE_RANKINGS = ("maskgit_plus", "entropy")
# the published ``alg`` values refused, with why
UNSERVED_ALGS = {
    "topk_margin": "it ranks by the top-1 minus the top-2 probability, which the engine's "
                   "proposals do not carry",
    "origin": "it unmasks each position with probability 1 - t_next / t, drawn even at "
              "temperature 0, which the engine does not reproduce",
}


@functools.lru_cache(maxsize=64)
def timesteps(steps: int, eps: float) -> torch.Tensor:
    """[steps + 1] float32: ``linspace(1, eps, steps + 1)`` as the published loop makes
    them (shared, never written)."""
    return torch.linspace(1, eps, steps + 1)


def batched_timestep_quota(num_masked: torch.Tensor, steps_taken: torch.Tensor,
                           steps_allowed: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """[R] int64: the masked positions each block unmasks at its step (the module doc).
    num_masked, steps_taken, steps_allowed: [R] int64; eps: [R] float64 (the options'
    values, so that the timesteps are exactly the published ones)."""
    ratio = torch.zeros(len(num_masked), dtype=torch.float32)  # [R] 1 - t_next / t
    for steps, value in set(zip(steps_allowed.tolist(), eps.tolist())):
        group = (steps_allowed == steps) & (eps == value)  # one schedule: float32 as published
        times = timesteps(steps, value)
        step = steps_taken[group].clamp(max=steps - 1)
        ratio[group] = 1 - times[step + 1] / times[step]
    quota = (num_masked.to(torch.float32) * ratio).long()  # truncated, as int()
    return torch.where(steps_taken >= steps_allowed - 1, num_masked, quota)


class TimestepSchedule(CommitRule):
    name = "timestep_schedule"

    def needs_entropy(self, config) -> bool:
        return config.alg == "entropy"

    def _quota(self, blocks: RuleBlocks) -> torch.Tensor:  # [R]
        return batched_timestep_quota(blocks.num_masked, blocks.taken, blocks.allowed,
                                      blocks.option("eps", torch.float64))

    def step(self, blocks: RuleBlocks) -> torch.Tensor:
        by_entropy = torch.tensor([c.alg == "entropy" for c in blocks.configs])  # [R]
        score = blocks.confidence
        if bool(by_entropy.any()):
            if blocks.entropy is None:
                raise ValueError("the timestep_schedule strategy's 'entropy' alg needs "
                                 "each proposal's entropy")
            score = torch.where(by_entropy[:, None], -blocks.entropy, score)
        score = torch.where(blocks.candidates, score, torch.full_like(score, float("-inf")))
        return (rank_by_score(score)[1] < self._quota(blocks)[:, None]) & blocks.candidates

    def idle(self, blocks: RuleBlocks) -> list[bool]:
        """The blocks with candidates whose quota truncates to 0 before their last step."""
        return ((blocks.num_masked > 0) & (self._quota(blocks) == 0)).tolist()
