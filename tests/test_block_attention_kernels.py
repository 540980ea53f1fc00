"""The Triton block-causal paged attention kernel against the torch reference, on a named
grid of shapes. Natively where CUDA is available; otherwise through Triton's interpreter
(TRITON_INTERPRET=1) in a subprocess, because the variable must be set before Triton is
first imported and vLLM imports it early. Run as a script, this file prints the maximum
error of every case as JSON."""

from __future__ import annotations

import importlib
import importlib.util
import json

import pytest
import torch
from kernel_harness import kernel_errors

from vllm_diffusion.kernels.block_attention import block_causal_attention

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

# name: (query rows per request as (first position, count, stride), kv lens, diffusion block,
#        page size, heads, kv heads, head dim, dtype, permuted cache layout)
GRID = {
    "one-block-gqa": ([(8, 4, 1)], [12], 4, 16, 4, 2, 32, torch.float32, False),
    "prefill-and-block": ([(0, 24, 1)], [24], 8, 16, 4, 4, 64, torch.float32, False),
    "ragged-three-requests": ([(16, 16, 1), (4, 4, 1), (33, 7, 2)], [32, 8, 48], 16, 16, 8, 2,
                              32, torch.float32, False),
    "subset-of-block": ([(64, 10, 3)], [96], 32, 32, 2, 1, 64, torch.float32, False),
    "head-dim-80": ([(8, 8, 1)], [16], 8, 8, 2, 2, 80, torch.float32, False),
    "strided-cache": ([(4, 4, 1), (0, 8, 1)], [8, 8], 4, 8, 4, 2, 32, torch.float32, True),
    "bfloat16": ([(16, 8, 2)], [32], 16, 16, 4, 2, 64, torch.bfloat16, False),
    # prefill chunks longer than LONG_QUERY_RUN next to blocks: attended in separate calls
    "prefill-among-blocks": ([(0, 100, 1), (64, 16, 1), (0, 80, 1), (32, 8, 1)],
                             [100, 80, 80, 40], 16, 16, 4, 2, 32, torch.float32, False),
}


def kernel_module():
    return importlib.import_module("vllm_diffusion.kernels.triton_block_attention")


def make_case(requests, kv_lens, block, page, heads, kv_heads, dim, dtype, permuted, device):
    gen = torch.Generator().manual_seed(len(requests) * 1000 + dim + block)
    max_pages = max(-(-n // page) for n in kv_lens)
    num_pages = len(kv_lens) * max_pages + 3
    if permuted:  # a non-contiguous view, as vLLM's layer-interleaved layouts give
        storage = torch.randn(page, num_pages, kv_heads, 2 * dim, generator=gen)
        kv_cache = storage.permute(1, 2, 0, 3)
    else:
        kv_cache = torch.randn(num_pages, kv_heads, page, 2 * dim, generator=gen)
    block_table = torch.randperm(num_pages, generator=gen)[:len(kv_lens) * max_pages]
    block_table = block_table.view(len(kv_lens), max_pages)
    positions = torch.cat([torch.arange(first, first + count * stride, stride)
                           for first, count, stride in requests])
    starts = [0]
    for _, count, _ in requests:
        starts.append(starts[-1] + count)
    query = torch.randn(len(positions), heads, dim, generator=gen)
    return (query.to(device, dtype), kv_cache.to(device, dtype), positions.to(device), starts,
            kv_lens, block_table.to(device), block, dim ** -0.5)


def max_errors(device: str) -> dict[str, float]:
    errors = {}
    for name, case in GRID.items():
        args = make_case(*case, device=device)
        got = kernel_module().block_causal_attention(*args)
        want = block_causal_attention(*args)
        errors[name] = (got.float() - want.float()).abs().max().item()
    return errors


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return kernel_errors(__file__, max_errors)


@pytest.mark.parametrize("case", GRID.values(), ids=GRID.keys())
def test_padded_torch_attention_matches_reference(case):
    from vllm_diffusion.kernels.block_attention import padded_block_causal_attention

    args = make_case(*case, device="cpu")
    tolerance = 2e-2 if case[7] == torch.bfloat16 else 1e-5
    torch.testing.assert_close(padded_block_causal_attention(*args).float(),
                               block_causal_attention(*args).float(),
                               rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("case", GRID.values(), ids=GRID.keys())
def test_one_plan_serves_every_layer_of_a_step(case):
    """The step-fixed part planned once, attended with two layers' queries and caches."""
    from vllm_diffusion.kernels.block_attention import attend_padded, plan_padded_attention

    first = make_case(*case, device="cpu")
    second = make_case(*case, device="cpu")
    query, kv_cache, positions, loc, kv_lens, table, block, scale = first
    plan = plan_padded_attention(positions, loc, kv_lens, table, block, kv_cache.shape[2],
                                 query.shape[1] // kv_cache.shape[1])
    tolerance = 2e-2 if case[7] == torch.bfloat16 else 1e-5
    for layer_query, layer_cache in ((query, kv_cache), (second[0] * 0.5, kv_cache * 2)):
        want = block_causal_attention(layer_query, layer_cache, *first[2:])
        torch.testing.assert_close(attend_padded(layer_query, layer_cache, plan, scale).float(),
                                   want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", GRID)
def test_triton_kernel_matches_torch_reference(errors, name):
    tolerance = 2e-2 if GRID[name][7] == torch.bfloat16 else 1e-4
    assert errors[name] <= tolerance


if __name__ == "__main__":
    print(json.dumps(max_errors("cpu")))

