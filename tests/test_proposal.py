"""The proposal pipeline's slots and the request admission stay in step: a sampling
parameter whose slot has no stage is refused, never silently ignored."""

from __future__ import annotations

import pytest

from vllm_diffusion import requests
from vllm_diffusion.worker import proposal

REFUSED = {name for name, _, _ in requests._UNSUPPORTED}


@pytest.mark.parametrize("slot", proposal.SLOT_PARAMETERS)
def test_a_slot_is_filled_or_its_parameters_refused(slot):
    """A slot with a stage has its parameters admitted; one without has them refused."""
    for parameter in proposal.SLOT_PARAMETERS[slot]:
        if proposal.LOGIT_STAGES[slot] is None:
            assert parameter in REFUSED, f"{parameter} has no stage but admission accepts it"
        else:
            assert parameter not in REFUSED, f"{parameter} has a stage but is refused"


def test_stages_follow_the_sampler_order():
    """The pipeline runs its logit stages in the listed order, and the order shows in the
    proposals: the logit bias comes before the penalties (as in vLLM's sampler, whose
    logits processors run before ``apply_penalties``), and the mask token stays barred
    whatever bias a request gives it."""
    import types

    import torch

    assert proposal.STAGES == (
        "allowed_token_ids", "bad_words", "min_tokens", "logit_bias", "penalties", "grammar",
        "mask_token", "temperature", "top_k_top_p", "draw", "commit_choice")
    mask = 3
    pipeline = proposal.ProposalPipeline(mask_token_id=mask)
    logit_slots = [name for name in proposal.STAGES if name in proposal.SLOT_PARAMETERS]
    assert [stage.__name__ for stage in pipeline.logit_stages] == logit_slots
    # Token 0 is in the prompt: repetition penalty 2 halves its biased logit, (2 + 2) / 2
    # = 2.0, below token 1's 2.6; penalised first and biased after, it would be 2 / 2 + 2
    # = 3.0 and win. Token 3, the mask, would win at 1 + 100 were it not barred.
    logits = torch.tensor([[2.0, 2.6, 0.0, 1.0]])
    params = types.SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0,
                                   allowed_token_ids=None, logit_bias={0: 2.0, mask: 100.0},
                                   repetition_penalty=2.0, frequency_penalty=0.0,
                                   presence_penalty=0.0)
    proposals = pipeline.propose(logits.clone(), [1], [params], [None],
                                 seen_tokens=[([0], [])])
    assert proposals.tokens.tolist() == [1]
    # greedy confidence: token 1's probability over the final logits [2.0, 2.6, 0.0, -inf]
    final = torch.tensor([2.0, 2.6, 0.0, float("-inf")])
    assert proposals.confidence.tolist() == pytest.approx([final.softmax(-1)[1].item()])


def test_allowed_token_ids_and_logit_bias_apply_to_every_row_of_their_request():
    """Per-position logit stages: a request's allowed_token_ids bar every other token at
    each of its rows, its logit_bias shifts those rows' logits; other requests' rows are
    untouched."""
    import types

    import torch

    logits = torch.randn(7, 16, generator=torch.Generator().manual_seed(0))
    params = [types.SimpleNamespace(allowed_token_ids=[2, 5], logit_bias=None),
              types.SimpleNamespace(allowed_token_ids=None, logit_bias={3: 50.0, 4: -1.5}),
              types.SimpleNamespace(allowed_token_ids=None, logit_bias=None)]
    batch = proposal.ProposalBatch(logits.clone(), [3, 2, 2], params, [None] * 3)
    proposal.allowed_token_ids(batch)
    proposal.logit_bias(batch)
    first, second, third = batch.logits[:3], batch.logits[3:5], batch.logits[5:]
    assert torch.isinf(first).sum() == 3 * 14
    assert torch.equal(first[:, [2, 5]], logits[:3, [2, 5]])
    assert torch.allclose(second[:, 3], logits[3:5, 3] + 50.0)
    assert torch.allclose(second[:, 4], logits[3:5, 4] - 1.5)
    assert torch.equal(second[:, :3], logits[3:5, :3]) and torch.equal(third, logits[5:])
    tokens = proposal.ProposalPipeline(mask_token_id=0).propose(
        logits.clone(), [3, 2, 2], [types.SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0,
                                                          **vars(p)) for p in params],
        [None] * 3).tokens
    assert set(tokens[:3].tolist()) <= {2, 5} and tokens[3:5].tolist() == [3, 3]


def test_penalties_follow_vllms_definitions():
    """Repetition divides positive logits (multiplies negative ones) of tokens in the prompt
    or the output; frequency subtracts per output occurrence, presence once; a request
    without penalties is untouched. Checked against a plain loop."""
    import types

    import torch

    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(1)) * 3
    params = [types.SimpleNamespace(repetition_penalty=1.5, frequency_penalty=0.4,
                                    presence_penalty=0.3),
              types.SimpleNamespace(repetition_penalty=1.0, frequency_penalty=0.0,
                                    presence_penalty=0.0)]
    seen = [([1, 2, 2], [3, 3, 4, 2]), ([5], [6])]
    batch = proposal.ProposalBatch(logits.clone(), [3, 2], params, [None] * 2,
                                   seen_tokens=seen)
    proposal.penalties(batch)
    prompt, output = seen[0]
    for row in range(3):
        for token in range(12):
            want = float(logits[row, token])
            if token in prompt or token in output:
                want = want / 1.5 if want > 0 else want * 1.5
            want -= 0.4 * output.count(token) + 0.3 * (token in output)
            assert abs(float(batch.logits[row, token]) - want) < 1e-5
    assert torch.equal(batch.logits[3:], logits[3:])


def random_proposals(n: int, ranked: int, logprob_rows: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return proposal.Proposals(
        tokens=torch.randint(0, 50_000, (n,), generator=gen),
        confidence=torch.rand(n, generator=gen),
        entropy=torch.rand(n, generator=gen),
        logprobs=torch.randn(logprob_rows, 6, generator=gen, dtype=torch.float64)
        if logprob_rows else None,
        ranked=torch.randint(0, 50_000, (n, ranked), generator=gen) if ranked else None,
        invalid=torch.randint(0, 4, (n,), generator=gen).to(torch.int8))


@pytest.mark.parametrize("ranked,logprob_rows", [(0, 0), (3, 0), (0, 2), (2, 5)])
def test_one_copy_to_host_gives_each_tensor_back(ranked, logprob_rows):
    """The packed float64 copy unpacks to the proposals."""
    import torch

    from vllm_diffusion.worker.proposal_grid import one_copy_to_host

    proposed = random_proposals(5, ranked, logprob_rows)
    got = one_copy_to_host(proposed)
    want = (proposed.tokens, proposed.confidence, proposed.invalid, proposed.entropy,
            proposed.ranked, proposed.logprobs)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g.to(w.dtype), w, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["whole", "ragged", "reordered"])
def test_scatter_to_host_places_each_proposal(layout):
    """The [R, B] grid against a loop placing each row; whole grids (a reshape) and
    partial or reordered ones (a scatter), with ranked alternatives and logprobs."""
    import torch

    from vllm_diffusion.worker.proposal_grid import scatter_to_host

    blocks, block_size, mask = 3, 4, 7
    where = [(b, p) for b in range(blocks) for p in range(block_size)]
    if layout == "ragged":
        where = [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3), (2, 3)]
    elif layout == "reordered":
        where = where[4:] + where[:4]
    asks = [True, False, True]
    logprob_rows = sum(asks[b] for b, _ in where)
    proposed = random_proposals(len(where), 2, logprob_rows, seed=len(where))
    grid = scatter_to_host(proposed, torch.tensor(where), blocks, block_size, mask, asks)
    logprob_row = 0
    for row, (b, p) in enumerate(where):
        assert grid.tokens[b, p] == proposed.tokens[row]
        assert grid.confidence[b, p] == proposed.confidence[row]
        assert grid.entropy[b, p] == proposed.entropy[row]
        assert grid.invalid[b, p] == proposed.invalid[row]
        assert grid.ranked[b, p].tolist() == proposed.ranked[row].tolist()
        assert grid.computed[b, p]
        if asks[b]:
            assert grid.logprobs[b, p].tolist() == proposed.logprobs[logprob_row].tolist()
            logprob_row += 1
    placed = set(where)
    for b in range(blocks):
        for p in range(block_size):
            if (b, p) not in placed:
                assert grid.tokens[b, p] == mask and not grid.computed[b, p]
                assert grid.confidence[b, p] == float("-inf")
    assert (grid.tokens.dtype, grid.confidence.dtype, grid.invalid.dtype,
            grid.computed.dtype) == (torch.long, torch.float32, torch.int8, torch.bool)
