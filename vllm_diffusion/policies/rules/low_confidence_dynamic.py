"""``low_confidence_dynamic`` (SDAR's ``generate.py``, the default rule): commit every
candidate whose confidence is above ``threshold`` if there are at least the step's quota
of them (SDAR's schedule, ``blocks.step_quota``), else the quota's most confident (ties
to the lower position)."""

from __future__ import annotations

import torch

from vllm_diffusion.policies.rules.blocks import HostPathRule, RuleBlocks, as_float32, step_quota


class LowConfidenceDynamic(HostPathRule):
    name = "low_confidence_dynamic"

    @staticmethod
    def host_choice(confidence, candidates, taken, allowed, config):
        count = min(step_quota(len(confidence), allowed, taken), len(candidates))
        threshold = as_float32(config.threshold)
        above = [j for j in candidates if confidence[j] > threshold]
        if len(above) >= count:
            return set(above)
        return set(sorted(candidates, key=lambda j: (-confidence[j], j))[:count])

    def by_tensors(self, blocks: RuleBlocks) -> torch.Tensor:
        above = blocks.candidates & (blocks.confidence > blocks.option("threshold")[:, None])
        enough = above.sum(dim=1, keepdim=True) >= blocks.quota  # [R, 1]
        return above if bool(enough.all()) else torch.where(enough, above,
                                                            blocks.top_by_quota)
