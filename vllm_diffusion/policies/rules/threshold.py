"""``threshold`` (LMDeploy, SGLang's ``low_confidence``): commit the most confident
candidate (the first of ties) and every candidate whose confidence is at least
``threshold``; at the block's last allowed step, every candidate."""

from __future__ import annotations

import torch

from vllm_diffusion.policies.rules.blocks import HostPathRule, RuleBlocks, as_float32


class Threshold(HostPathRule):
    name = "threshold"

    @staticmethod
    def host_choice(confidence, candidates, taken, allowed, config):
        if taken >= allowed - 1:
            return candidates
        threshold = as_float32(config.threshold)
        best = max(candidates, key=lambda j: (confidence[j], -j))
        return {j for j in candidates if confidence[j] >= threshold or j == best}

    def by_tensors(self, blocks: RuleBlocks) -> torch.Tensor:
        candidates = blocks.candidates
        # argmax keeps the first of ties, as the stable ranking does
        best = torch.zeros_like(candidates).scatter_(
            1, blocks.masked_confidence.argmax(dim=1, keepdim=True), True)
        chosen = candidates & ((blocks.confidence >= blocks.option("threshold")[:, None])
                               | best)
        return torch.where(blocks.last_step, candidates, chosen)
