"""The named grids of shapes ``verify_kernels.py`` runs each kernel on, and the builders
of each op's arguments (seeded, on a device, in a dtype)."""

from __future__ import annotations

import math

import torch

CUDA_ONLY = frozenset({"serving-batch", "long-prefill"})
SERVING_BLOCKS = [(1024 + 64 * r, 32) for r in range(16)]  # (block start, rows) x 16
# requests: (first query position, rows, position stride) each; kv_lens: keys per request;
# block: diffusion block size; page: page size; permuted: a non-contiguous cache view.
BLOCK_ATTENTION_FIELDS = ("requests", "kv_lens", "block", "page", "heads", "kv_heads",
                          "head_dim", "permuted")
BLOCK_ATTENTION_GRID = {
    "one-block-gqa": ([(8, 4, 1)], [12], 4, 16, 4, 2, 32, False),
    "prefill-and-block": ([(0, 24, 1)], [24], 8, 16, 4, 4, 64, False),
    "ragged-three-requests": ([(16, 16, 1), (4, 4, 1), (33, 7, 2)], [32, 8, 48], 16, 16, 8,
                              2, 32, False),
    "subset-of-block": ([(64, 10, 3)], [96], 32, 32, 2, 1, 64, False),
    "head-dim-80": ([(8, 8, 1)], [16], 8, 8, 2, 2, 80, False),
    "gqa4-head-dim-72-keys-past-tile": ([(48, 8, 1), (32, 1, 1)], [56, 33], 8, 16, 4, 1, 72,
                                        False),
    "strided-cache": ([(4, 4, 1), (0, 8, 1)], [8, 8], 4, 8, 4, 2, 32, True),
    "page-size-5-empty-request": ([(20, 10, 1), (0, 0, 1), (3, 5, 1)], [30, 4, 8], 10, 5, 4,
                                  1, 48, True),
    "prefill-run-past-64": ([(0, 66, 1), (16, 4, 1)], [66, 20], 8, 16, 2, 1, 32, False),
    "page-size-1": ([(4, 4, 1)], [8], 4, 1, 2, 1, 32, False),
    "no-query-rows": ([(0, 0, 1)], [4], 4, 16, 2, 2, 32, False),
    "prefill-among-blocks": ([(0, 100, 1), (64, 16, 1), (0, 80, 1), (32, 8, 1)],
                             [100, 80, 80, 40], 16, 16, 4, 2, 32, False),
    "serving-batch": ([(start, rows, 1) for start, rows in SERVING_BLOCKS],
                      [start + rows for start, rows in SERVING_BLOCKS], 32, 16, 32, 8, 128,
                      False),
    "long-prefill": ([(0, 512, 1)], [512], 32, 16, 32, 8, 128, False),
}
# requests: (block start = prefix length, rows, kv len) each; share: of the prefix kept;
# per_kv_head: a kept list per KV head (else one list shared by all).
SPARSE_PREFIX_FIELDS = ("requests", "block", "page", "heads", "kv_heads", "head_dim", "share",
                        "per_kv_head", "permuted")
SPARSE_PREFIX_GRID = {
    "one-request-gqa": ([(32, 8, 40)], 8, 16, 4, 2, 32, 0.5, False, False),
    "ragged-three": ([(64, 16, 80), (16, 4, 20), (96, 32, 128)], 16, 16, 8, 2, 32, 0.3, True,
                     False),
    "no-prefix-kept": ([(48, 4, 52), (8, 4, 12)], 4, 8, 2, 2, 64, 0.0, False, False),
    "all-kept": ([(24, 8, 32)], 8, 8, 4, 1, 64, 1.0, True, False),
    "partial-block-keys": ([(64, 5, 69)], 32, 32, 2, 1, 64, 0.2, False, False),
    "strided-cache": ([(8, 4, 12), (16, 8, 24)], 4, 8, 4, 2, 32, 0.4, False, True),
    "first-block-empty-request-dim-80": ([(0, 4, 4), (16, 0, 16), (40, 8, 48)], 8, 16, 4, 2,
                                         80, 0.5, True, True),
    "page-size-5-kept-past-tile": ([(70, 6, 76)], 6, 5, 6, 3, 48, 0.6, True, False),
    "serving-batch": ([(start, rows, start + rows) for start, rows in SERVING_BLOCKS], 32, 16,
                      32, 8, 128, 0.25, True, False),
}
# counts: candidates per request (0: none); kernels: max-pool kernel per request.
IMPORTANCE_FIELDS = ("counts", "heads", "kv_heads", "head_dim", "kernels")
IMPORTANCE_GRID = {
    "one-request-b4": ([3], 4, 2, 32, [3]),
    "ragged-requests": ([5, 0, 16, 1], 4, 2, 64, [3, 3, 3, 3]),
    "block32-mha": ([32], 8, 8, 64, [3]),
    "block64-gqa": ([64, 40], 4, 1, 128, [3, 3]),
    "mixed-pool-kernels": ([9, 9, 9], 2, 1, 16, [1, 3, 5]),
    "count-20-head-dim-80": ([20, 7], 4, 2, 80, [3, 5]),
    "no-candidates": ([0, 0], 2, 1, 32, [3, 3]),
    "serving-batch": ([32] * 64, 32, 8, 128, [3] * 64),
}
# levels: distinct delta values (ties when few).
SELECTION_FIELDS = ("requests", "block", "levels")
SELECTION_GRID = {"b1": (8, 1, 2), "b4": (16, 4, 1000), "b16-ties": (24, 16, 3),
                  "b20-not-power-of-two": (12, 20, 1000), "b32": (24, 32, 1000),
                  "b64-ties": (16, 64, 5), "serving-batch": (256, 32, 1000)}
COMPACTION_FIELDS = ("rows", "width", "kept", "residual")
COMPACTION_GRID = {"few-kept": (40, 64, 5, True), "all-kept": (16, 256, 16, True),
                   "width-3000": (12, 3000, 7, True), "width-1000": (33, 1000, 17, True),
                   "no-residual": (10, 96, 3, False), "nothing-kept": (8, 64, 0, True),
                   "serving-batch": (2048, 4096, 1500, True)}
GRIDS = {op: {name: dict(zip(fields, values)) for name, values in grid.items()}
         for op, fields, grid in (
             ("block_attention", BLOCK_ATTENTION_FIELDS, BLOCK_ATTENTION_GRID),
             ("sparse_prefix_attention", SPARSE_PREFIX_FIELDS, SPARSE_PREFIX_GRID),
             ("candidate_importance", IMPORTANCE_FIELDS, IMPORTANCE_GRID),
             ("select_retained", SELECTION_FIELDS, SELECTION_GRID),
             ("compact_rows", COMPACTION_FIELDS, COMPACTION_GRID))}
REDUCED_GRID = {"block_attention": ("gqa4-head-dim-72-keys-past-tile",
                                    "page-size-5-empty-request", "prefill-run-past-64",
                                    "no-query-rows"),
                "sparse_prefix_attention": ("first-block-empty-request-dim-80",
                                            "page-size-5-kept-past-tile"),
                "candidate_importance": ("ragged-requests", "mixed-pool-kernels",
                                         "no-candidates"),
                "select_retained": ("b1", "b16-ties", "b20-not-power-of-two"),
                "compact_rows": ("width-3000", "no-residual", "nothing-kept")}


def paged_attention_args(point, gen, dtype, device, query_rows):
    """(query, kv_cache, query_positions, query_start_loc, kv_lens, block_table,
    diffusion_block_size, scale): the shared leading arguments of both attention ops."""
    kv_lens, page = point["kv_lens"], point["page"]
    kv_heads, dim = point["kv_heads"], point["head_dim"]
    max_pages = max(-(-n // page) for n in kv_lens)
    num_pages = len(kv_lens) * max_pages + 3
    if point["permuted"]:  # a non-contiguous view, as vLLM's interleaved layouts give
        storage = torch.randn(page, num_pages, kv_heads, 2 * dim, generator=gen)
        kv_cache = storage.to(device, dtype).permute(1, 2, 0, 3)  # [pages, H_kv, page, 2D]
    else:
        kv_cache = torch.randn(num_pages, kv_heads, page, 2 * dim, generator=gen)
        kv_cache = kv_cache.to(device, dtype)
    table = torch.randperm(num_pages, generator=gen)[:len(kv_lens) * max_pages]
    positions = torch.cat([torch.arange(first, first + rows * stride, stride)
                           for first, rows, stride in query_rows])  # [T]
    starts = [0]
    for _, rows, _ in query_rows:
        starts.append(starts[-1] + rows)
    query = torch.randn(len(positions), point["heads"], dim, generator=gen)  # [T, H, D]
    return (query.to(device, dtype), kv_cache, positions.to(device), starts, list(kv_lens),
            table.view(len(kv_lens), max_pages).to(device), point["block"], dim ** -0.5)


def block_attention_args(point, gen, dtype, device):
    return paged_attention_args(point, gen, dtype, device, point["requests"])


def sparse_prefix_args(point, gen, dtype, device):
    requests = point["requests"]
    shared = paged_attention_args({**point, "kv_lens": [n for _, _, n in requests]}, gen, dtype,
                                  device, [(start, rows, 1) for start, rows, _ in requests])
    prefix_lens = [start for start, _, _ in requests]
    keep = [math.floor(point["share"] * n) for n in prefix_lens]
    kept = torch.full((len(requests), point["kv_heads"], max(keep + [1])), -1,
                      dtype=torch.long)  # [R, H_kv, K] ascending, -1 padding
    for r, (n, k) in enumerate(zip(prefix_lens, keep)):
        shared_order = torch.randperm(n, generator=gen)
        for h in range(point["kv_heads"]):
            order = torch.randperm(n, generator=gen) if point["per_kv_head"] else shared_order
            kept[r, h, :k] = order[:k].sort().values
    return (*shared, kept.to(device), prefix_lens)


def importance_args(point, gen, dtype, device):
    counts = point["counts"]
    total = sum(counts) + 7  # other rows (prefill, decoded positions) between candidates
    query = torch.randn(total, point["heads"], point["head_dim"], generator=gen)
    key = torch.randn(total, point["kv_heads"], point["head_dim"], generator=gen)
    order = torch.randperm(total, generator=gen)
    rows, start = [], 0
    for n in counts:  # ascending query rows of each request's candidates, or None
        rows.append(None if n == 0 else order[start:start + n].sort().values.to(device))
        start += n
    return (query.to(device, dtype), key.to(device, dtype), rows, point["head_dim"] ** -0.5,
            list(point["kernels"]))


def selection_args(point, gen, dtype, device):
    requests, block, levels = point["requests"], point["block"], point["levels"]
    delta = torch.randint(0, levels, (requests, block), generator=gen).float() / levels
    processing = torch.rand(requests, block, generator=gen) < 0.8
    processing[0] = True  # a first step of a block
    candidates = processing & (torch.rand(requests, block, generator=gen) < 0.7)
    candidates[1 % requests] = False  # nothing masked
    ever = torch.rand(requests, block, generator=gen) < 0.5
    budgets = torch.randint(0, block + 1, (requests,), generator=gen)
    selected_left = torch.rand(requests, generator=gen) < 0.5  # the two context rules
    return (delta.to(device, dtype), *[t.to(device) for t in (candidates, budgets, processing,
                                                             ever, selected_left)])


def compaction_args(point, gen, dtype, device):
    hidden = torch.randn(point["rows"], point["width"], generator=gen).to(device, dtype)
    residual = torch.randn(point["rows"], point["width"], generator=gen).to(device, dtype)
    keep = torch.randperm(point["rows"], generator=gen)[:point["kept"]].sort().values
    return hidden, residual if point["residual"] else None, keep.to(device)


BUILDERS = {"block_attention": block_attention_args,
            "sparse_prefix_attention": sparse_prefix_args,
            "candidate_importance": importance_args, "select_retained": selection_args,
            "compact_rows": compaction_args}
