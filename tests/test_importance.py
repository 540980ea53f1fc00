"""FOCUS importance (Eq. 2-3): the torch implementation against a naive loop on a named
grid of shapes, and the engine's recorded deltas against the reference model's q/k."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import diffusion_llm
from reference_sdar import ReferenceSDAR, block_causal_mask
from test_parity import checkpoint_info

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_diffusion.kernels.importance import candidate_importance
from vllm_diffusion_lab.recording import start_importance_recording, take_importance_records

# (candidates, query heads, kv heads, head dim, pool kernel)
GRID = {
    "single": (1, 4, 2, 16, 3),
    "pair": (2, 4, 2, 16, 3),
    "block8-gqa": (8, 8, 2, 32, 3),
    "block32-mha": (32, 4, 4, 64, 3),
    "no-pool": (5, 4, 1, 16, 1),
    "pool5": (7, 2, 1, 8, 5),
}


def naive_importance(query, key, scale, kernel):
    n, heads, _ = query.shape
    group = heads // key.shape[1]
    importance = [0.0] * n
    for h in range(heads):
        for a in range(n):
            scores = [float(query[a, h] @ key[b, h // group]) * scale for b in range(n)]
            half = kernel // 2
            pooled = [max(scores[max(0, b - half):b + half + 1]) for b in range(n)]
            top = max(pooled)
            weights = [math.exp(s - top) for s in pooled]
            total = sum(weights)
            for b in range(n):
                importance[b] += weights[b] / total
    return torch.tensor(importance)


@pytest.mark.parametrize("shape", GRID.values(), ids=GRID.keys())
def test_importance_matches_naive_loop(shape):
    n, heads, kv_heads, dim, kernel = shape
    gen = torch.Generator().manual_seed(n * 100 + dim)
    query = torch.randn(n, heads, dim, generator=gen)
    key = torch.randn(n, kv_heads, dim, generator=gen)
    got = candidate_importance(query, key, dim ** -0.5, kernel)
    torch.testing.assert_close(got, naive_importance(query, key, dim ** -0.5, kernel),
                               rtol=1e-5, atol=1e-5)
    assert got.sum().item() == pytest.approx(heads * n, rel=1e-5)  # each query row sums to 1


def test_batched_importance_equals_per_request_importance():
    from vllm_diffusion.kernels.importance import batched_candidate_importance

    gen = torch.Generator().manual_seed(7)
    query, key = torch.randn(60, 4, 16, generator=gen), torch.randn(60, 2, 16, generator=gen)
    rows = [torch.tensor([1, 4, 5, 9]), None, torch.arange(20, 52), torch.tensor([55]),
            torch.arange(10, 17)]
    kernels = [3, 3, 5, 3, 1]
    got = batched_candidate_importance(query, key, rows, 0.25, kernels)
    for r, kernel, value in zip(rows, kernels, got):
        if r is None:
            assert value is None
            continue
        torch.testing.assert_close(value, candidate_importance(query[r], key[r], 0.25, kernel),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.engine
def test_engine_records_the_reference_importance_delta(dense_checkpoint):
    block_size = 8
    mask_id, _, _ = checkpoint_info(dense_checkpoint)
    prompt = [17, 23, 42, 99, 150, 7, 64, 88, 12, 31, 201]  # one block plus a tail of 3
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                            extra_args={"strategy": "sequential"})
    with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size) as llm:
        start_importance_recording(llm)
        llm.generate(TokensPrompt(prompt_token_ids=prompt), params, use_tqdm=False)
        records = take_importance_records(llm)
    # sequential decodes one position per step: 5 steps over the first block's 5 masks.
    assert [len(r["decoded"]) for r in records] == [5, 4, 3, 2, 1]
    assert all(r["decoded"][0] and sum(r["decoded"]) == 1 for r in records)
    assert [r["positions"] for r in records] == [list(range(11 + i, 16)) for i in range(5)]

    reference = ReferenceSDAR(dense_checkpoint)
    tokens = torch.tensor(prompt + [mask_id] * 5)
    reference.captured_qk = []
    reference.forward(tokens, block_causal_mask(len(tokens), block_size))
    candidates = torch.arange(11, 16)  # the masked positions of the first block
    scale = reference.head_dim ** -0.5
    layer0, layer1 = (candidate_importance(q[candidates], k[candidates], scale)
                      for q, k in reference.captured_qk[:2])
    torch.testing.assert_close(torch.tensor(records[0]["layer1"]), layer1, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(torch.tensor(records[0]["delta"]), layer1 - layer0,
                               rtol=1e-3, atol=1e-3)


def test_recording_policy_delegates_the_whole_policy_interface():
    """Every method and attribute of the interface is the wrapped policy's, so recording
    changes no decision (a method added to the interface must be delegated too)."""
    from vllm_diffusion.policies.base import DecodingPolicy
    from vllm_diffusion_lab.recording import RecordingPolicy

    interface = {name for name in vars(DecodingPolicy) if not name.startswith("_")}
    assert interface <= set(vars(RecordingPolicy)), interface - set(vars(RecordingPolicy))
    for name in ("name", "config_cls", "block_size", "mask_token_id", "engine_config",
                 "proposal_ranks"):
        assert name in vars(RecordingPolicy), name
