"""Triton kernel for ``compaction.compact_rows``: both gathers in one launch (CUDA)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _compact_rows_kernel(hidden_ptr, residual_ptr, keep_ptr, hidden_out_ptr, residual_out_ptr,
                         width, stride_hidden, stride_residual, stride_out,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < width
    source = tl.load(keep_ptr + row)
    values = tl.load(hidden_ptr + source * stride_hidden + columns, mask=inside)
    tl.store(hidden_out_ptr + row * stride_out + columns, values, mask=inside)
    if HAS_RESIDUAL:
        values = tl.load(residual_ptr + source * stride_residual + columns, mask=inside)
        tl.store(residual_out_ptr + row * stride_out + columns, values, mask=inside)


def compact_rows(hidden: torch.Tensor, residual: torch.Tensor | None,
                 keep_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See ``compaction.compact_rows``."""
    rows, width = len(keep_rows), hidden.shape[1]
    hidden_out = torch.empty(rows, width, dtype=hidden.dtype, device=hidden.device)
    residual_out = None if residual is None else torch.empty_like(hidden_out)
    if rows == 0:
        return hidden_out, residual_out
    assert hidden.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    block = min(triton.next_power_of_2(width), 1024)
    _compact_rows_kernel[(rows, triton.cdiv(width, block))](
        hidden, hidden if residual is None else residual,
        keep_rows.to(device=hidden.device, dtype=torch.int64), hidden_out,
        hidden_out if residual_out is None else residual_out, width, hidden.stride(0),
        hidden.stride(0) if residual is None else residual.stride(0), hidden_out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block)
    return hidden_out, residual_out
