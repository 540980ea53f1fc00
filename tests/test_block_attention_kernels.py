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
from kernel_harness import kernel_errors, torch_side
from paged_cases import GRID, make_case

from vllm_diffusion.kernels.block_attention import block_causal_attention

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)


def kernel_module():
    return importlib.import_module("vllm_diffusion.kernels.triton_block_attention")


def max_errors(device: str) -> dict[str, float]:
    errors = {}
    for name, case in GRID.items():
        args = make_case(*case, device=device)
        got = kernel_module().block_causal_attention(*args)
        want = block_causal_attention(*torch_side(args))
        errors[name] = (got.float() - want.float()).abs().max().item()
    return errors


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return kernel_errors(__file__, max_errors)


@pytest.mark.parametrize("case", GRID.values(), ids=GRID.keys())
def test_padded_torch_attention_matches_reference(case):
    from vllm_diffusion.kernels.block_attention import padded_block_causal_attention

    args = torch_side(make_case(*case, device="cpu"))
    tolerance = 2e-2 if case[7] == torch.bfloat16 else 1e-5
    torch.testing.assert_close(padded_block_causal_attention(*args).float(),
                               block_causal_attention(*args).float(),
                               rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("case", GRID.values(), ids=GRID.keys())
def test_one_plan_serves_every_layer_of_a_step(case):
    """The step-fixed part planned once, attended with two layers' queries and caches."""
    from vllm_diffusion.kernels.block_attention import attend_padded, plan_padded_attention

    first = torch_side(make_case(*case, device="cpu"))
    second = torch_side(make_case(*case, device="cpu"))
    query, kv_cache, positions, loc, kv_lens, table, block, scale = first
    plan = plan_padded_attention(positions, loc, kv_lens, table, block, kv_cache.shape[2],
                                 query.shape[1] // kv_cache.shape[1])
    tolerance = 2e-2 if case[7] == torch.bfloat16 else 1e-5
    for layer_query, layer_cache in ((query, kv_cache), (second[0] * 0.5, kv_cache * 2)):
        want = block_causal_attention(layer_query, layer_cache, *first[2:])
        torch.testing.assert_close(attend_padded(layer_query, layer_cache, plan, scale).float(),
                                   want.float(), rtol=tolerance, atol=tolerance)
        into = torch.zeros_like(layer_query)  # the layer's output buffer
        assert attend_padded(layer_query, layer_cache, plan, scale, into) is into
        torch.testing.assert_close(into.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", GRID)
def test_triton_kernel_matches_torch_reference(errors, name):
    tolerance = 2e-2 if GRID[name][7] == torch.bfloat16 else 1e-4
    assert errors[name] <= tolerance


@pytest.mark.parametrize("dtype,longest_tile", [(torch.bfloat16, 64), (torch.float32, 32)])
def test_tiles_cover_every_row_once_within_its_request(dtype, longest_tile):
    """The Triton kernels' tiles: rows of one request each, every row in exactly one."""
    query_start_loc, kv_lens = [0, 100, 100, 104, 140, 141], [100, 7, 40, 80, 9]
    tiles, num_tiles, block_m = kernel_module().plan_tiles(query_start_loc, kv_lens, "cpu",
                                                           dtype)
    assert block_m == longest_tile and tiles.shape == (4, num_tiles)
    covered = []
    for request, first, end, kv_len in tiles.T.tolist():
        assert query_start_loc[request] <= first < end <= query_start_loc[request + 1]
        assert end - first <= block_m and kv_len == kv_lens[request]
        covered += range(first, end)
    assert covered == list(range(141))
    assert kernel_module().plan_tiles([0, 4, 8], [8, 8], "cpu", dtype)[2] == 16


if __name__ == "__main__":
    print(json.dumps(max_errors("cpu")))

