"""Named grids of paged-attention calls shared by the kernel tests: the query rows of each
request, their key counts, the diffusion block, the page size, heads, dtype and whether the
cache is a non-contiguous view. ``make_case`` builds a call's arguments with an
interleaved cache, as the Triton kernels read it (``kernel_harness.torch_side`` gives the
torch code's arrangement)."""

from __future__ import annotations

import torch

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
