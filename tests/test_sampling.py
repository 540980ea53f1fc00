"""Batched proposals against the per-request reference, on a named grid of sampling
settings: the same tokens and confidences, seeded draws included."""

from __future__ import annotations

import types

import pytest
import torch
from reference_sampling import propose_tokens

from vllm_diffusion.worker.proposal import ProposalPipeline

MASK = 3


def propose_for_requests(logits: torch.Tensor, mask_token_id: int, counts: list[int],
                         params: list, generators: list,
                         confidence_rule: str = "sampled_token"
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's proposals (tokens, confidences) for the rows of several requests."""
    proposals = ProposalPipeline(mask_token_id, confidence_rule).propose(logits, counts,
                                                                         params, generators)
    return proposals.tokens, proposals.confidence


def params(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0):
    return types.SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p,
                                 min_p=min_p)


# name: per request (rows, sampling parameters, seed or None)
GRID = {
    "greedy-only": [(4, params(), None), (7, params(), None)],
    "mixed": [(3, params(), None), (5, params(0.7), 1), (2, params(1.0, top_k=20), 2),
              (6, params(0.9, top_p=0.85), 3), (1, params(1.3, top_k=5, top_p=0.5), 4)],
    "tiny-top-p": [(4, params(1.0, top_p=1e-30), 5), (4, params(), None)],
    "top-k-past-vocab": [(3, params(0.8, top_k=10_000), 6), (2, params(0.8, top_k=1), 7)],
    "min-p": [(4, params(1.0, min_p=0.2), 8), (3, params(0.7, top_k=10, min_p=0.05), 9),
              (2, params(), None), (3, params(1.2), 10)],
}


@pytest.mark.parametrize("rule", ["sampled_token", "max_probability"])
@pytest.mark.parametrize("name", GRID)
def test_batched_proposals_equal_per_request_proposals(name, rule):
    requests = GRID[name]
    gen = torch.Generator().manual_seed(len(name))
    logits = torch.randn(sum(n for n, _, _ in requests), 64, generator=gen) * 3

    def generators():
        return [torch.Generator().manual_seed(s) if s is not None else None
                for _, _, s in requests]

    tokens, confidence = propose_for_requests(
        logits.clone(), MASK, [n for n, _, _ in requests], [p for _, p, _ in requests],
        generators(), confidence_rule=rule)
    offset = 0
    for (n, p, _), generator in zip(requests, generators()):
        want_tokens, want_confidence = propose_tokens(
            logits[offset:offset + n].clone(), MASK, p.temperature, p.top_k, p.top_p,
            generator, max_probability=rule == "max_probability", min_p=p.min_p)
        assert tokens[offset:offset + n].tolist() == want_tokens.tolist()
        torch.testing.assert_close(confidence[offset:offset + n], want_confidence,
                                   rtol=0, atol=0)
        offset += n
    assert MASK not in tokens.tolist()


def test_max_probability_confidence_draws_the_same_tokens():
    """The confidence rule changes the confidences of sampled rows only: the draws are the
    same, a sampled row's confidence is its distribution's largest probability (at least
    the drawn token's), greedy rows agree under both rules."""
    requests = GRID["mixed"]
    logits = torch.randn(sum(n for n, _, _ in requests), 64,
                         generator=torch.Generator().manual_seed(9)) * 3
    results = {}
    for rule in ("sampled_token", "max_probability"):
        results[rule] = propose_for_requests(
            logits.clone(), MASK, [n for n, _, _ in requests], [p for _, p, _ in requests],
            [torch.Generator().manual_seed(s) if s is not None else None
             for _, _, s in requests], confidence_rule=rule)
    (tokens, drawn), (same_tokens, largest) = results.values()
    assert torch.equal(tokens, same_tokens)
    assert bool((largest >= drawn).all()) and bool((largest > drawn).any())
    greedy = requests[0][0]
    assert torch.equal(largest[:greedy], drawn[:greedy])


@pytest.mark.parametrize("counts,max_rows,want", [
    ([4, 4, 4], 8, [(0, 2), (2, 3)]),
    ([4, 4, 4], 100, [(0, 3)]),
    ([32, 3, 5], 8, [(0, 1), (1, 3)]),  # a request larger than a chunk stays whole
    ([1, 1, 1, 1], 1, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    ([], 8, []),
])
def test_request_chunks_keep_requests_whole(counts, max_rows, want):
    from vllm_diffusion.worker.proposal import request_chunks

    assert request_chunks(counts, max_rows) == want


@pytest.mark.parametrize("max_rows", [1, 5, 9])
@pytest.mark.parametrize("name", GRID)
def test_chunked_logits_give_the_same_proposals(name, max_rows):
    """Logits made and reduced a chunk of requests at a time: the same tokens and
    confidences (to the last bit of the logits' matmul) as the whole step at once (seeded
    draws included), and never more than
    ``max_rows`` rows of logits at once unless one request has more."""
    from vllm_diffusion.worker.proposal import ProposalPipeline

    requests = GRID[name]
    counts = [n for n, _, _ in requests]
    gen = torch.Generator().manual_seed(len(name))
    hidden = torch.randn(sum(counts), 16, generator=gen)
    head = torch.randn(64, 16, generator=gen) * 2
    shapes = []

    def compute_logits(rows):
        shapes.append(rows.shape[0])
        return rows @ head.T

    def generators():
        return [torch.Generator().manual_seed(s) if s is not None else None
                for _, _, s in requests]

    params = [p for _, p, _ in requests]
    whole = ProposalPipeline(MASK).propose(compute_logits(hidden), counts, params, generators())
    shapes.clear()
    chunked = ProposalPipeline(MASK, max_rows=max_rows).propose_from_hidden(
        compute_logits, hidden, counts, params, generators())
    assert torch.equal(chunked.tokens, whole.tokens)
    # a matmul over fewer rows may round differently in the last bit (seen: 1.5e-6 relative
    # in a probability on an AMD EPYC host)
    torch.testing.assert_close(chunked.confidence, whole.confidence, rtol=1e-5, atol=1e-7)
    assert sum(shapes) == sum(counts)
    assert max(shapes) <= max(max_rows, max(counts))


def test_min_p_keeps_only_tokens_near_the_most_likely_one():
    """With min_p, every drawn token's probability (after temperature) is at least min_p
    times its row's largest; without it, over many draws some are not."""
    logits = torch.randn(200, 64, generator=torch.Generator().manual_seed(4)) * 2
    reference = (logits / 0.9).softmax(dim=-1)
    reference[:, MASK] = 0
    for min_p, held in ((0.3, True), (0.0, False)):
        tokens, _ = propose_for_requests(logits.clone(), MASK, [200],
                                         [params(0.9, min_p=min_p)],
                                         [torch.Generator().manual_seed(1)])
        chosen = reference.gather(1, tokens[:, None]).squeeze(1)
        ratio = chosen / reference.max(dim=1).values
        assert bool((ratio >= 0.3 - 1e-6).all()) == held


def test_proposal_entropies_are_of_the_distribution_proposed_from():
    """With entropies asked for: greedy rows give their softmax's entropy, sampled rows
    that of the scaled, filtered distribution they were drawn from (a top-k of 1 leaves
    one token: entropy 0); tokens and confidences are unchanged."""
    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(2)) * 2
    requests = [(3, params(), None), (2, params(1.0, top_k=1), 1), (1, params(0.5), 2)]
    counts, batch_params = [n for n, _, _ in requests], [p for _, p, _ in requests]

    def generators():
        return [torch.Generator().manual_seed(s) if s is not None else None
                for _, _, s in requests]

    from vllm_diffusion.worker.proposal import ProposalPipeline

    result = ProposalPipeline(MASK).propose(logits.clone(), counts, batch_params, generators(),
                                            with_entropy=True)
    tokens, confidence, entropy = result.tokens, result.confidence, result.entropy
    plain = ProposalPipeline(MASK).propose(logits.clone(), counts, batch_params, generators())
    assert torch.equal(tokens, plain.tokens) and torch.equal(confidence, plain.confidence)
    greedy = logits[:3].clone()
    greedy[:, MASK] = float("-inf")
    probs = greedy.softmax(dim=-1)
    torch.testing.assert_close(entropy[:3], torch.special.entr(probs).sum(dim=-1))
    assert torch.equal(entropy[3:5], torch.zeros(2))
    assert float(entropy[5]) > 0
