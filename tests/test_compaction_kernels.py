"""The Triton row-compaction kernel against the torch reference, on a named grid of shapes.
Natively on CUDA, else through Triton's interpreter in a subprocess."""

from __future__ import annotations

import importlib
import importlib.util
import json

import pytest
import torch
from kernel_harness import kernel_errors

from vllm_diffusion.kernels.compaction import compact_rows

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

# name: (rows, hidden width, kept rows, with residual, dtype)
GRID = {
    "few-kept": (40, 64, 5, True, torch.float32),
    "all-kept": (16, 256, 16, True, torch.float32),
    "wide-bf16": (12, 3000, 7, True, torch.bfloat16),
    "no-residual": (10, 96, 3, False, torch.float32),
    "nothing-kept": (8, 64, 0, True, torch.float32),
}


def make_case(rows, width, kept, with_residual, dtype, device):
    gen = torch.Generator().manual_seed(rows * 7 + width)
    hidden = torch.randn(rows, width, generator=gen).to(device, dtype)
    residual = torch.randn(rows, width, generator=gen).to(device, dtype) if with_residual else None
    keep = torch.randperm(rows, generator=gen)[:kept].sort().values.to(device)
    return hidden, residual, keep


def max_errors(device: str) -> dict[str, float]:
    kernel = importlib.import_module("vllm_diffusion.kernels.triton_compaction")
    errors = {}
    for name, case in GRID.items():
        args = make_case(*case, device=device)
        got, want = kernel.compact_rows(*args), compact_rows(*args)
        errors[name] = max(0.0 if g is None and w is None else
                           float((g.float() - w.float()).abs().max()) if g.numel() else 0.0
                           for g, w in zip(got, want))
        if got[0].shape != want[0].shape:
            errors[name] = float("inf")
    return errors


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return kernel_errors(__file__, max_errors)


@pytest.mark.parametrize("name", GRID)
def test_triton_compaction_matches_torch_reference(errors, name):
    assert errors[name] == 0


if __name__ == "__main__":
    print(json.dumps(max_errors("cpu")))
