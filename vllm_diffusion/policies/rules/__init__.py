"""Unmasking rules: which masked positions of a block a step commits. One module per rule,
each a ``blocks.CommitRule`` registered in ``RULES`` (the ``strategy`` option's values, in
this order); ``choose_commits`` decides a step's blocks, each by its own rule. Token
editing (``token_editing.py``) and the rewriting loop (``joint_editing.py``) decide on
filled tokens; ``parts/strategy_unmasking.py`` composes them. The rules' semantics:
docs/policies.md, "standard"; their plain reference: ``tests/reference_unmasking.py``.
"""

from __future__ import annotations

import torch

from vllm_diffusion.policies.rules.blocks import CommitRule, RuleBlocks
from vllm_diffusion.policies.rules.entropy_bounded import EntropyBounded
from vllm_diffusion.policies.rules.factor import Factor
from vllm_diffusion.policies.rules.low_confidence_dynamic import LowConfidenceDynamic
from vllm_diffusion.policies.rules.low_confidence_static import LowConfidenceStatic
from vllm_diffusion.policies.rules.sequential import Sequential
from vllm_diffusion.policies.rules.threshold import Threshold
from vllm_diffusion.policies.rules.timestep_schedule import TimestepSchedule

RULES: dict[str, CommitRule] = {rule.name: rule for rule in (
    LowConfidenceDynamic(), LowConfidenceStatic(), Sequential(), Threshold(),
    EntropyBounded(), TimestepSchedule(), Factor())}


# the rules whose schedule leaves some steps empty by design (they override ``idle``)
SCHEDULED = frozenset(name for name, rule in RULES.items()
                      if type(rule).idle is not CommitRule.idle)


def _by_rule(blocks: RuleBlocks) -> dict[str, list[int]]:
    """Each followed rule's blocks (indices), in the order first followed."""
    groups: dict[str, list[int]] = {}
    for i, config in enumerate(blocks.configs):
        groups.setdefault(config.strategy, []).append(i)
    return groups


def choose_commits(blocks: RuleBlocks) -> torch.Tensor:
    """[R, B] bool: what each block commits by its own rule (``config.strategy``)."""
    groups = _by_rule(blocks)
    if len(groups) == 1:  # the common step: one rule for every block
        return RULES[next(iter(groups))].step(blocks)
    chosen = torch.zeros_like(blocks.candidates)
    for name, index in groups.items():
        chosen[index] = RULES[name].step(blocks.rows(index))
    return chosen


def scheduled_idle(blocks: RuleBlocks) -> list[bool]:
    """Per block: whether its rule's schedule commits nothing this step by design."""
    idle = [False] * len(blocks.configs)
    for name, index in _by_rule(blocks).items():
        if name in SCHEDULED:
            for i, value in zip(index, RULES[name].idle(blocks.rows(index))):
                idle[i] = value
    return idle


__all__ = ["RULES", "SCHEDULED", "CommitRule", "RuleBlocks", "choose_commits",
           "scheduled_idle"]
