"""The ``timestep_schedule`` strategy's quota and ranking: Dream's ``diffusion_generate``.

A block of ``steps`` denoising steps walks the timesteps ``linspace(1, eps, steps + 1)``
(float32); at block step ``s`` (``t = timesteps[s]``, ``t_next = timesteps[s + 1]``) it
unmasks ``int(M * (1 - t_next / t))`` of its M masked positions, computed in float32 as
the published loop does (the truncation decides the count), and every remaining one at
its last step (``s >= steps - 1``). The count is 0 at some steps (as many steps as masks:
the first step's is ``int(M * 0.999 / M)`` = 0); such a step commits nothing by design
(``StrategyUnmasking.scheduled_idle``), and the last step commits every mask left, so a
block ends within ``steps`` steps.

The positions unmasked are the top count by the published ``alg`` (``SCHEDULE_RANKINGS``):
``maskgit_plus`` ranks by the proposal's probability (the engine's confidence: the
argmax's probability when greedy, the drawn token's when sampled, as the published
``sample_tokens``), ``entropy`` by the negative entropy of the position's proposal
distribution. Ties go to the lower position (the published ``torch.topk`` leaves their
order unspecified). Dream's ``topk_margin`` and ``origin`` are refused (``UNSERVED_ALGS``).
"""

from __future__ import annotations

import functools

import torch

# the published ``alg`` values the strategy ranks by (index: the batched ``alg`` code)
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
                           steps_allowed: torch.Tensor, eps: torch.Tensor,
                           scheduled: torch.Tensor) -> torch.Tensor:
    """[R] int64: the masked positions each ``scheduled`` block unmasks at its step (0
    elsewhere): ``int(M * (1 - t_{s+1} / t_s))``, every one at the last allowed step
    (plain reference: ``tests/reference_unmasking.py``).

    num_masked, steps_taken, steps_allowed: [R] int64; eps: [R] float64 (the options'
    values, so that the timesteps are exactly the published ones); scheduled: [R] bool.
    """
    ratio = torch.zeros(len(num_masked), dtype=torch.float32)  # [R] 1 - t_next / t
    pairs = zip(steps_allowed[scheduled].tolist(), eps[scheduled].tolist())
    for steps, value in set(pairs):  # one group per schedule: float32 as published
        group = scheduled & (steps_allowed == steps) & (eps == value)
        times = timesteps(steps, value)
        step = steps_taken[group].clamp(max=steps - 1)
        ratio[group] = 1 - times[step + 1] / times[step]
    quota = (num_masked.to(torch.float32) * ratio).long()  # truncated, as int()
    last = steps_taken >= steps_allowed - 1
    return torch.where(scheduled, torch.where(last, num_masked, quota),
                       torch.zeros_like(num_masked))


def schedule_score(confidence: torch.Tensor, entropy: torch.Tensor | None,
                   ranking: torch.Tensor) -> torch.Tensor:
    """[R, B] float: what the schedule ranks masked positions by. confidence: [R, B];
    entropy: [R, B] (needed where a block ranks by ``entropy``); ranking: [R] int64, an
    index into ``SCHEDULE_RANKINGS``."""
    by_entropy = ranking == SCHEDULE_RANKINGS.index("entropy")
    if not bool(by_entropy.any()):
        return confidence
    if entropy is None:
        raise ValueError("the timestep_schedule strategy's 'entropy' alg needs each "
                         "proposal's entropy")
    return torch.where(by_entropy[:, None], -entropy, confidence)
