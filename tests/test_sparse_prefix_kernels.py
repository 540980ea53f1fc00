"""Prefix-sparse attention and prefix selection against plain references, on a named grid.

The Triton kernel is compared with the torch reference natively where CUDA is available,
otherwise through Triton's interpreter in a subprocess (see ``kernel_harness``); run as a
script, this file prints the maximum error of every case as JSON. The vectorised torch
path and vLLM's CPU kernel over the kept keys' stores (the CPU paths) are compared with
the reference directly, and keeping every prefix position must give exactly the dense
block-causal attention.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math

import pytest
import torch
from kernel_harness import kernel_errors, torch_side
from paged_cases import make_case

from vllm_diffusion.attention.cpu_attention import cpu_kernel_supports, kept_pages_attention
from vllm_diffusion.kernels.block_attention import block_causal_attention, gather_kv
from vllm_diffusion.kernels.kv_pages import key_value_views
from vllm_diffusion.kernels.sparse_prefix import (KeptKV, compacted_sparse_prefix_attention,
                                                    gathered_sparse_prefix_attention,
                                                    select_prefix, sparse_prefix_attention)

# name: (block rows per request as (block start, rows, kv len), diffusion block, page size,
#        heads, kv heads, head dim, dtype, permuted cache, kept share, per kv head)
GRID = {
    "one-request-gqa": ([(32, 8, 40)], 8, 16, 4, 2, 32, torch.float32, False, 0.5, False),
    "ragged-three": ([(64, 16, 80), (16, 4, 20), (96, 32, 128)], 16, 16, 8, 2, 32,
                     torch.float32, False, 0.3, True),
    "no-prefix-kept": ([(48, 4, 52), (8, 4, 12)], 4, 8, 2, 2, 64, torch.float32, False, 0.0,
                       False),
    "all-kept": ([(24, 8, 32)], 8, 8, 4, 1, 64, torch.float32, False, 1.0, True),
    "partial-block-keys": ([(64, 5, 69)], 32, 32, 2, 1, 64, torch.float32, False, 0.2, False),
    "head-dim-80": ([(16, 8, 24)], 8, 8, 2, 2, 80, torch.float32, False, 0.5, True),
    "strided-cache": ([(8, 4, 12), (16, 8, 24)], 4, 8, 4, 2, 32, torch.float32, True, 0.4,
                      False),
    "bfloat16": ([(128, 16, 144)], 16, 16, 4, 2, 64, torch.bfloat16, False, 0.1, True),
}


def sparse_case(requests, block, page, heads, kv_heads, dim, dtype, permuted, share,
                per_kv_head, device):
    """Arguments of the sparse attention: block rows of each request (ascending from its
    block start) and a random kept subset of its prefix, per KV head or shared."""
    query_rows = [(start, rows, 1) for start, rows, _ in requests]
    args = make_case(query_rows, [n for _, _, n in requests], block, page, heads, kv_heads,
                     dim, dtype, permuted, device)
    gen = torch.Generator().manual_seed(len(requests) * 7 + dim)
    prefix_lens = [start for start, _, _ in requests]
    keep = [math.floor(share * n) for n in prefix_lens]
    lists = torch.full((len(requests), kv_heads, max(keep + [1])), -1, dtype=torch.long)
    for r, (n, k) in enumerate(zip(prefix_lens, keep)):
        for h in range(kv_heads):
            source = h if per_kv_head else 0
            order = torch.randperm(n, generator=torch.Generator().manual_seed(r * 31 + source))
            lists[r, h, :k] = order[:k].sort().values
    del gen
    return (*args, lists.to(device), prefix_lens)


def kernel_module():
    return importlib.import_module("vllm_diffusion.kernels.triton_sparse_prefix")


def max_errors(device: str) -> dict[str, float]:
    errors = {}
    for name, case in GRID.items():
        args = sparse_case(*case, device=device)
        got = kernel_module().sparse_prefix_attention(*args)
        want = sparse_prefix_attention(*torch_side(args))
        errors[name] = (got.float() - want.float()).abs().max().item()
    return errors


def tolerance(case) -> float:
    return 2e-2 if case[6] == torch.bfloat16 else 1e-5


@pytest.mark.parametrize("case", GRID.values(), ids=GRID.keys())
def test_gathered_torch_path_matches_reference(case):
    args = torch_side(sparse_case(*case, device="cpu"))
    torch.testing.assert_close(gathered_sparse_prefix_attention(*args).float(),
                               sparse_prefix_attention(*args).float(),
                               rtol=tolerance(case), atol=tolerance(case))


def attend_over_two_steps(path, args, tol) -> list[KeptKV]:
    """``path`` with stores, on a first call and on a second whose block keys changed (a
    later step of the block), each against the reference; returns the stores."""
    stores = [KeptKV() for _ in args[4]]
    for _ in range(2):
        torch.testing.assert_close(path(*args, stores).float(),
                                   sparse_prefix_attention(*args).float(), rtol=tol, atol=tol)
        kv_cache, table, page = args[1], args[5], args[1].shape[2]
        for r, (start, end) in enumerate(zip(args[9], args[4])):
            for position in range(start, end):  # the block's keys change, the rest stays
                for view in key_value_views(kv_cache):
                    view[table[r, position // page], :, position % page] += 0.5
    return stores


@pytest.mark.parametrize("case", GRID.values(), ids=GRID.keys())
def test_compacted_torch_path_matches_reference_across_steps(case):
    """The CPU path's stores, filled on the first call, serve a second call whose block
    keys changed (a later step of the block): both equal the reference."""
    args = torch_side(sparse_case(*case, device="cpu"))
    stores = attend_over_two_steps(compacted_sparse_prefix_attention, args, tolerance(case))
    assert all(s.keys is not None and s.keys.shape[1] == s.kept + n - p
               for s, n, p in zip(stores, args[4], args[9]))


VLLM_GRID = {name: case for name, case in GRID.items()
             if case[2] % 16 == 0 and not case[7] and cpu_kernel_supports(case[5])}


@pytest.mark.parametrize("case", VLLM_GRID.values(), ids=VLLM_GRID.keys())
def test_vllm_kernel_path_matches_reference_across_steps(case):
    """vLLM's CPU kernel over each request's store (the CPU path where vLLM has a kernel
    for the head size; its pages a multiple of 16 positions, the cache contiguous): the
    store filled on the first call serves a second call whose block keys changed."""
    args = torch_side(sparse_case(*case, device="cpu"))
    stores = attend_over_two_steps(kept_pages_attention, args, tolerance(case))
    block = case[1]
    if any((start + rows - 1) // block > start // block for start, rows, _ in case[0]):
        # rows over several diffusion blocks (a mask inside the block): the torch path
        assert all(s.pages is None and s.keys is not None for s in stores)
        return
    assert all(s.pages is not None and len(s.block_slots) == n - p
               and s.pages.shape[0] * s.pages.shape[2] >= s.kept + n - p
               for s, n, p in zip(stores, args[4], args[9]))
    assert all(s.keys is None for s in stores)  # the torch path's store stayed unused


def test_vllm_kernel_path_masks_rows_over_several_blocks():
    """Rows that reach over more than one diffusion block need a mask inside the block:
    that call takes the torch path, and equals the reference."""
    requests = [(32, 16, 48)]  # 16 rows at positions 32-47 with diffusion blocks of 8
    args = torch_side(sparse_case(requests, 8, 16, 4, 2, 32, torch.float32, False, 0.5, False,
                                  device="cpu"))
    stores = [KeptKV()]
    torch.testing.assert_close(kept_pages_attention(*args, stores),
                               sparse_prefix_attention(*args), rtol=1e-5, atol=1e-5)
    assert stores[0].pages is None and stores[0].keys is not None


def test_kept_context_after_the_block():
    """Full attention: a block's kept positions lie before and after it (Sparse-dLLM's
    bidirectional eviction); the reference, the gathered and the compacted paths attend to
    exactly those keys plus the block."""
    block_start, rows, end = 32, 8, 64
    query, kv_cache, positions, starts, _, table, _, scale = make_case(
        [(block_start, rows, 1)], [end], 8, 8, 4, 2, 32, torch.float32, False, "cpu")
    span = 1 << 20  # the whole sequence is one attention span
    outside = torch.cat([torch.arange(block_start), torch.arange(block_start + rows, end)])
    kept = outside[torch.randperm(len(outside), generator=torch.Generator().manual_seed(3))
                   [:20]].sort().values
    kept_index = kept[None, None].repeat(1, 2, 1)
    args = (query, kv_cache, positions, starts, [block_start + rows], table, span, scale,
            kept_index, [block_start])
    keys, values = gather_kv(kv_cache, table[0], end)
    seen = torch.cat([kept, torch.arange(block_start, block_start + rows)])
    k = keys[seen].transpose(0, 1).repeat_interleave(2, dim=0)  # [H, N, D]
    v = values[seen].transpose(0, 1).repeat_interleave(2, dim=0)
    want = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), k, v, scale=scale).transpose(0, 1)
    for path in (sparse_prefix_attention, gathered_sparse_prefix_attention):
        torch.testing.assert_close(path(*args), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compacted_sparse_prefix_attention(*args, [KeptKV()]), want,
                               rtol=1e-5, atol=1e-5)
    if cpu_kernel_supports(32):
        page16 = make_case([(block_start, rows, 1)], [end], 8, 16, 4, 2, 32, torch.float32,
                           False, "cpu")
        args16 = (*page16[:4], [block_start + rows], page16[5], span, scale, kept_index,
                  [block_start])
        torch.testing.assert_close(kept_pages_attention(*args16, [KeptKV()]),
                                   sparse_prefix_attention(*args16), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [c for c in GRID.values() if c[6] == torch.float32],
                         ids=[n for n, c in GRID.items() if c[6] == torch.float32])
def test_unkept_prefix_keys_contribute_nothing(case):
    """Poisoning every prefix key that is not kept leaves the output unchanged; keeping the
    whole prefix gives the dense block-causal attention."""
    args = torch_side(sparse_case(*case, device="cpu"))
    query, kv_cache, positions, starts, kv_lens, table, block, scale, kept, prefix_lens = args
    want = sparse_prefix_attention(*args)
    page = kv_cache.shape[2]
    poisoned = kv_cache.clone()
    for r, n in enumerate(prefix_lens):
        for h in range(kv_cache.shape[1]):
            dropped = set(range(n)) - set(kept[r, h][kept[r, h] >= 0].tolist())
            for k in dropped:
                for view in key_value_views(poisoned):
                    view[table[r, k // page], h, k % page] = 1e3
    again = (query, poisoned, positions, starts, kv_lens, table, block, scale, kept, prefix_lens)
    torch.testing.assert_close(sparse_prefix_attention(*again), want)
    torch.testing.assert_close(gathered_sparse_prefix_attention(*again), want,
                               rtol=1e-5, atol=1e-5)
    everything = torch.stack([torch.arange(max(prefix_lens + [1]))] * kv_cache.shape[1])
    everything = everything[None].repeat(len(kv_lens), 1, 1)
    for r, n in enumerate(prefix_lens):
        everything[r, :, n:] = -1
    dense = block_causal_attention(*args[:8])
    torch.testing.assert_close(
        gathered_sparse_prefix_attention(*args[:8], everything, prefix_lens), dense,
        rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return kernel_errors(__file__, max_errors)


@pytest.mark.parametrize("name", GRID)
def test_triton_kernel_matches_torch_reference(errors, name):
    assert errors[name] <= max(tolerance(GRID[name]), 1e-4)


def reference_selection(block_query, keys, scale, keep, kernel, per_kv_head):
    """Plain loops: mean block query per head, dot products, mean over the heads (of a
    group), max over the kernel window, top ``keep`` by (score desc, position asc)."""
    heads, kv_heads = block_query.shape[1], keys.shape[1]
    group = heads // kv_heads
    lists = []
    for selection in (range(kv_heads) if per_kv_head else [None]):
        chosen_heads = (range(selection * group, (selection + 1) * group)
                        if per_kv_head else range(heads))
        scores = []
        for j in range(keys.shape[0]):
            total = 0.0
            for h in chosen_heads:
                mean_q = block_query[:, h].double().mean(0)
                total += float(mean_q @ keys[j, h // group].double()) * scale
            scores.append(total / len(chosen_heads))
        half = kernel // 2
        pooled = [max(scores[max(0, j - half):j + half + 1]) for j in range(len(scores))]
        order = sorted(range(len(pooled)), key=lambda j: (-pooled[j], j))
        lists.append(sorted(order[:keep]))
    return torch.tensor(lists)


@pytest.mark.parametrize("prefix_len,keep,kernel,per_kv_head", [
    (40, 20, 3, False), (40, 20, 3, True), (17, 5, 1, False), (64, 6, 5, True),
    (9, 9, 3, False), (33, 0, 3, False)])
def test_selection_matches_plain_loops(prefix_len, keep, kernel, per_kv_head):
    gen = torch.Generator().manual_seed(prefix_len * 10 + keep)
    page, heads, kv_heads, dim = 8, 4, 2, 16
    num_pages = -(-prefix_len // page) + 2
    kv_cache = torch.randn(num_pages, kv_heads, page, 2 * dim, generator=gen)
    page_ids = torch.randperm(num_pages, generator=gen)
    block_query = torch.randn(6, heads, dim, generator=gen)
    got = select_prefix(block_query, kv_cache, page_ids, prefix_len, dim ** -0.5, keep,
                        kernel, per_kv_head)
    keys, _ = gather_kv(kv_cache, page_ids, prefix_len)
    want = reference_selection(block_query, keys, dim ** -0.5, keep, kernel, per_kv_head)
    assert got.tolist() == want.tolist()


if __name__ == "__main__":
    print(json.dumps(max_errors("cpu")))
