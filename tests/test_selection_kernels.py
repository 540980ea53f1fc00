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
from selection_cases import GRID, make_case

from vllm_diffusion.kernels.selection import batched_select_retained

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

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
