"""``low_confidence_static``: commit the step's quota of candidates (SDAR's schedule,
``blocks.step_quota``), the most confident first (ties to the lower position)."""

from __future__ import annotations

import torch

from vllm_diffusion.policies.rules.blocks import HostPathRule, RuleBlocks, step_quota


class LowConfidenceStatic(HostPathRule):
    name = "low_confidence_static"

    @staticmethod
    def host_choice(confidence, candidates, taken, allowed, config):
        count = min(step_quota(len(confidence), allowed, taken), len(candidates))
        return set(sorted(candidates, key=lambda j: (-confidence[j], j))[:count])

    def by_tensors(self, blocks: RuleBlocks) -> torch.Tensor:
        return blocks.top_by_quota
