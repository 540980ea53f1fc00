"""The runner's per-step host components, each timed on its own (pytest-benchmark), at
batch 1 and 64 with the default shape (block 4, the embedded model's vocabulary of 1,024):
planning, the step's model inputs, the CPU attention's step plan, the denoised blocks
after the forward, proposals, their scatter onto the host grid, the commit choice and
output building. A
regression in one of them shows here even when the step's total hides it.

    .venv/bin/python -m pytest benchmarks/host_components.py --benchmark-only \
        [--benchmark-json results/host_components.json]
"""

from __future__ import annotations

import types

import pytest
import torch

from vllm_diffusion.policies.standard import StandardConfig, StandardPolicy
from vllm_diffusion.step.plans import StepBlocks
from vllm_diffusion.step.request import DiffusionRequest
from vllm_diffusion.worker.geometry import BlockGeometry
from vllm_diffusion.worker.proposal import ProposalPipeline
from vllm_diffusion.worker.proposal_grid import scatter_to_host
from vllm_diffusion.worker.step_plan import (decode_steps, denoised_blocks, emit_final_tokens,
                                             gather_step, plan_request, step_inputs,
                                             truncate_at_stop)

BLOCK, VOCAB, MASK, PAGE = 4, 1024, 3, 16
PROMPT, OUTPUT = 90, 21  # tokens a request knows mid-generation
BATCHES = (1, 64)


def make_requests(batch: int, policy: StandardPolicy) -> list[DiffusionRequest]:
    return [DiffusionRequest(f"r{i}", StandardConfig(), policy.new_state(StandardConfig()),
                             False) for i in range(batch)]


def plan_all(requests, policy, geometry):
    """Every request's rows for a step that commits its previous block and denoises the
    next (the steady state of block-4 decoding)."""
    rows = []
    for i, request in enumerate(requests):
        tokens = [(7 * i + t) % (VOCAB - 8) + 8 for t in range(PROMPT + OUTPUT)]
        committed = (PROMPT + OUTPUT) // BLOCK * BLOCK - BLOCK
        reach = geometry.block_end(len(tokens)) - committed
        rows.append(plan_request(request.req_id, tokens, committed, reach, geometry, MASK,
                                 request, policy))
    return rows


@pytest.fixture
def policy():
    return StandardPolicy(BLOCK, MASK, StandardConfig())


@pytest.mark.parametrize("batch", BATCHES)
def test_planning(benchmark, batch, policy):
    requests, geometry = make_requests(batch, policy), BlockGeometry(BLOCK)
    benchmark(plan_all, requests, policy, geometry)


@pytest.mark.parametrize("batch", BATCHES)
def test_step_inputs(benchmark, batch, policy):
    rows = plan_all(make_requests(batch, policy), policy, BlockGeometry(BLOCK))
    pages = [list(range(10 * i, 10 * i + 8)) for i in range(batch)]
    benchmark(step_inputs, rows, pages, PAGE)


@pytest.mark.parametrize("batch", BATCHES)
def test_attention_plan(benchmark, batch, policy):
    """The CPU attention's segments and vLLM's work split, once per step."""
    from vllm_diffusion.attention.cpu_attention import plan_segments

    rows = plan_all(make_requests(batch, policy), policy, BlockGeometry(BLOCK))
    pages = [list(range(10 * i, 10 * i + 8)) for i in range(batch)]
    inputs = step_inputs(rows, pages, PAGE)
    kv_cache = torch.zeros(10 * batch, 2, PAGE, 2 * 64)
    benchmark(plan_segments, inputs.positions, inputs.query_start_loc, inputs.kv_lens,
              inputs.block_table, BLOCK, 4, kv_cache)


@pytest.mark.parametrize("batch", BATCHES)
def test_denoised_blocks(benchmark, batch, policy):
    rows = plan_all(make_requests(batch, policy), policy, BlockGeometry(BLOCK))
    step = gather_step(rows, torch.device("cpu"))
    benchmark(denoised_blocks, rows, step, torch.arange(step.num_rows))


@pytest.mark.parametrize("batch", BATCHES)
def test_scatter_to_host(benchmark, batch):
    from vllm_diffusion.worker.proposal import Proposals

    gen = torch.Generator().manual_seed(2)
    n = batch * BLOCK
    proposed = Proposals(torch.randint(8, VOCAB, (n,), generator=gen),
                         torch.rand(n, generator=gen), invalid=torch.zeros(n, dtype=torch.int8))
    where = torch.stack([torch.arange(batch).repeat_interleave(BLOCK),
                         torch.arange(BLOCK).repeat(batch)], 1)
    benchmark(scatter_to_host, proposed, where, batch, BLOCK, MASK)


@pytest.mark.parametrize("batch", BATCHES)
def test_proposals(benchmark, batch):
    logits = torch.randn(batch * BLOCK, VOCAB, generator=torch.Generator().manual_seed(0))
    greedy = types.SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0)
    pipeline = ProposalPipeline(MASK)
    benchmark(lambda: pipeline.propose(logits.clone(), [BLOCK] * batch, [greedy] * batch,
                                       [None] * batch))


@pytest.mark.parametrize("batch", BATCHES)
def test_commit_choice(benchmark, batch, policy):
    requests = make_requests(batch, policy)
    plan_all(requests, policy, BlockGeometry(BLOCK))
    gen = torch.Generator().manual_seed(1)
    confidence = torch.rand(batch, BLOCK, generator=gen)
    masked = torch.rand(batch, BLOCK, generator=gen) < 0.7
    tokens = torch.randint(8, VOCAB, (batch, BLOCK), generator=gen)
    benchmark(policy.decide, StepBlocks(requests, confidence, masked, tokens,
                                        torch.where(masked, MASK, tokens), ~masked))


@pytest.mark.parametrize("batch", BATCHES)
def test_output_building(benchmark, batch, policy):
    """Each request's newly final tokens, stop check and step map after a commit."""
    requests = make_requests(batch, policy)
    plan_all(requests, policy, BlockGeometry(BLOCK))
    params = types.SimpleNamespace(stop_token_ids=[1], eos_token_id=2, max_tokens=256)
    known = PROMPT + OUTPUT

    def build():
        out = []
        for request in requests:
            canvas = request.canvas
            decoded = emit_final_tokens(canvas.tokens.tolist(), canvas.start, known, MASK)
            final = truncate_at_stop(decoded, params, OUTPUT)
            out.append((final, decode_steps(canvas, known, len(final))))
        return out

    benchmark(build)
