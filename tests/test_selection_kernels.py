"""The Triton FOCUS selection kernel against the torch reference, on a named grid of
randomised blocks (ties in delta, frozen and never-processed positions, budgets from 0 to
the block size, both context rules). Natively on CUDA, else through Triton's interpreter
in a subprocess."""

from __future__ import annotations

import importlib
import importlib.util
import json

import pytest
import torch
from kernel_harness import kernel_errors

from vllm_diffusion.kernels.selection import batched_select_retained

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

# name: (requests, block size, distinct delta values (ties when small), seed)
GRID = {
    "b4": (16, 4, 1000, 1),
    "b16-ties": (24, 16, 3, 2),
    "b32": (24, 32, 1000, 3),
    "b64-ties": (16, 64, 5, 4),
    "b20-not-power-of-two": (12, 20, 1000, 5),
}


def make_case(requests, block, levels, seed, device):
    gen = torch.Generator().manual_seed(seed)
    delta = torch.randint(0, levels, (requests, block), generator=gen).float() / levels
    processing = torch.rand(requests, block, generator=gen) < 0.8
    processing[0] = True  # a first step of a block
    candidates = processing & (torch.rand(requests, block, generator=gen) < 0.7)
    candidates[1] = False  # nothing masked
    ever = torch.rand(requests, block, generator=gen) < 0.5
    budgets = torch.randint(0, block + 1, (requests,), generator=gen)
    selected_left = torch.rand(requests, generator=gen) < 0.5  # the two context rules
    return [t.to(device) for t in (delta, candidates, budgets, processing, ever, selected_left)]


def max_errors(device: str) -> dict[str, float]:
    kernel = importlib.import_module("vllm_diffusion.kernels.triton_selection")
    errors = {}
    for name, case in GRID.items():
        args = make_case(*case, device=device)
        got = kernel.batched_select_retained(*args).cpu()
        want = batched_select_retained(*[a.cpu() for a in args])
        errors[name] = float((got != want).sum())
    return errors


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return kernel_errors(__file__, max_errors)


@pytest.mark.parametrize("name", GRID)
def test_triton_selection_matches_torch_reference(errors, name):
    assert errors[name] == 0


if __name__ == "__main__":
    print(json.dumps(max_errors("cpu")))
