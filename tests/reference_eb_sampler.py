"""Plain-PyTorch reference of the EB-sampler's unmasking choice (Ben-Hamu et al., arXiv
2505.24857, Algorithm 1), written from the paper and the public implementations'
ordering (SGLang's ``EBSampling``, JetEngine: the masked positions by entropy, lowest
first), with plain loops, independently of the package. Same signature and result as
``vllm_diffusion.policies.rules.entropy_bounded.entropy_bounded_commits``.

Per block: the masked positions in order (by entropy ascending, or by confidence
descending where ``by_confidence``; ties to the lower position); the longest prefix whose
summed entropy minus its largest entropy is at most the bound, at least one position.
"""

from __future__ import annotations

import torch


def eb_order(confidence: list[float], masked: list[bool], entropy: list[float],
             by_confidence: bool) -> list[int]:
    """The masked positions of one block in the order the sampler takes them."""
    positions = [i for i in range(len(masked)) if masked[i]]
    if by_confidence:
        return sorted(positions, key=lambda i: (-confidence[i], i))
    return sorted(positions, key=lambda i: (entropy[i], i))


def eb_block(confidence: list[float], masked: list[bool], entropy: list[float],
             bound: float, by_confidence: bool) -> list[bool]:
    """One block's commits: the longest prefix of ``eb_order`` within the bound."""
    order = eb_order(confidence, masked, entropy, by_confidence)
    chosen = [False] * len(masked)
    for length in range(len(order), 0, -1):
        prefix = [entropy[i] for i in order[:length]]
        if length == 1 or sum(prefix) - max(prefix) <= bound:
            for i in order[:length]:
                chosen[i] = True
            break
    return chosen


def entropy_bounded_commits(confidence: torch.Tensor, masked: torch.Tensor,
                            entropy: torch.Tensor, entropy_bound: torch.Tensor,
                            by_confidence: torch.Tensor) -> torch.Tensor:
    """confidence, entropy: [R, B] float; masked: [R, B] bool; entropy_bound: [R] float;
    by_confidence: [R] bool. Returns [R, B] bool."""
    rows = [eb_block(confidence[r].tolist(), masked[r].tolist(), entropy[r].tolist(),
                     float(entropy_bound[r]), bool(by_confidence[r]))
            for r in range(masked.shape[0])]
    return torch.tensor(rows, dtype=torch.bool).reshape(masked.shape)
