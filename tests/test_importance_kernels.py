"""The Triton importance kernel against the torch reference, on a named grid of shapes
(natively on CUDA, else through Triton's interpreter in a subprocess; see
test_block_attention_kernels.py for why). Run as a script it prints the errors as JSON."""

from __future__ import annotations

import importlib
import importlib.util
import json

import pytest
import torch
from kernel_harness import kernel_errors

from vllm_diffusion.kernels.importance import batched_candidate_importance

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

# name: (candidates per request (0 = no block), heads, kv heads, head dim, pool kernels)
GRID = {
    "one-request-b4": ([3], 4, 2, 32, [3]),
    "ragged-requests": ([5, 0, 16, 1], 4, 2, 64, [3, 3, 3, 3]),
    "block32-mha": ([32], 8, 8, 64, [3]),
    "block64-gqa": ([64, 40], 4, 1, 128, [3, 3]),
    "mixed-pool-kernels": ([9, 9, 9], 2, 1, 16, [1, 3, 5]),
    "head-dim-80": ([12], 2, 2, 80, [3]),
}


def make_case(counts, heads, kv_heads, dim, kernels, device):
    gen = torch.Generator().manual_seed(sum(counts) * 31 + dim)
    total = sum(counts) + 7  # other rows (prefill, decoded positions) between candidates
    query = torch.randn(total, heads, dim, generator=gen)
    key = torch.randn(total, kv_heads, dim, generator=gen)
    order = torch.randperm(total, generator=gen)
    rows, start = [], 0
    for n in counts:
        rows.append(None if n == 0 else order[start:start + n].sort().values.to(device))
        start += n
    return query.to(device), key.to(device), rows, dim ** -0.5, kernels


def max_errors(device: str) -> dict[str, float]:
    kernel = importlib.import_module("vllm_diffusion.kernels.triton_importance")
    errors = {}
    for name, case in GRID.items():
        args = make_case(*case, device=device)
        got = kernel.batched_candidate_importance(*args)
        want = batched_candidate_importance(*args)
        assert [g is None for g in got] == [w is None for w in want]
        errors[name] = max([0.0] + [(g - w).abs().max().item()
                                    for g, w in zip(got, want) if g is not None])
    return errors


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return kernel_errors(__file__, max_errors)


@pytest.mark.parametrize("name", GRID)
def test_triton_importance_matches_torch_reference(errors, name):
    assert errors[name] <= 1e-4


if __name__ == "__main__":
    print(json.dumps(max_errors("cpu")))
