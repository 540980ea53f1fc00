"""``sequential``: commit the step's quota of candidates (SDAR's schedule,
``blocks.step_quota``), the leftmost first."""

from __future__ import annotations

import torch

from vllm_diffusion.policies.rules.blocks import HostPathRule, RuleBlocks, step_quota


class Sequential(HostPathRule):
    name = "sequential"

    @staticmethod
    def host_choice(confidence, candidates, taken, allowed, config):
        return candidates[:step_quota(len(confidence), allowed, taken)]

    def by_tensors(self, blocks: RuleBlocks) -> torch.Tensor:
        return blocks.candidates & (blocks.candidates.cumsum(dim=1) <= blocks.quota)
