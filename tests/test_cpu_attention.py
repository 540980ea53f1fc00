"""vLLM's CPU attention kernel running block-causal attention (``attention.cpu_attention``)
against the torch reference on the named grid of paged-attention calls, and its per-step
plan serving every layer of a step."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import torch_side
from paged_cases import GRID, make_case

from vllm_diffusion.attention.cpu_attention import (attend_segments, plan_segments,
                                                   segmented_block_causal_attention,
                                                   write_kv_with_vllm)
from vllm_diffusion.kernels.block_attention import block_causal_attention, write_kv
from vllm_diffusion.kernels.kv_pages import key_value_views, to_split

# The shared grid at the pages vLLM's CPU kernels take (a multiple of 16 positions; the
# backend asks vLLM for such pages on CPU), and two more shapes.
GRID = {name: (*case[:3], max(16, case[3]), *case[4:]) for name, case in GRID.items()}
GRID["page-64"] = ([(120, 8, 1), (40, 4, 1)], [128, 44], 4, 64, 4, 2, 64, torch.bfloat16,
                   False)
GRID["many-short-requests"] = ([(4 * i, 4, 1) for i in range(12)], [4 * i + 8 for i in range(12)],
                               4, 16, 4, 2, 64, torch.float32, False)


def tolerance(case) -> float:
    return 2e-2 if case[7] == torch.bfloat16 else 1e-5


@pytest.mark.parametrize("case", GRID.values(), ids=GRID.keys())
def test_vllm_cpu_kernel_matches_reference(case):
    args = torch_side(make_case(*case, device="cpu"))
    torch.testing.assert_close(segmented_block_causal_attention(*args).float(),
                               block_causal_attention(*args).float(),
                               rtol=tolerance(case), atol=tolerance(case))


@pytest.mark.parametrize("case", GRID.values(), ids=GRID.keys())
def test_one_segment_plan_serves_every_layer_of_a_step(case):
    query, kv_cache, positions, loc, kv_lens, table, block, scale = torch_side(
        make_case(*case, device="cpu"))
    plan = plan_segments(positions, loc, kv_lens, table, block, query.shape[1], kv_cache)
    for layer_query, layer_cache in ((query, kv_cache), (query.flip(0) * 0.5, kv_cache * 2)):
        want = block_causal_attention(layer_query, layer_cache, positions, loc, kv_lens,
                                      table, block, scale)
        torch.testing.assert_close(attend_segments(layer_query, layer_cache, plan,
                                                   scale).float(),
                                   want.float(), rtol=tolerance(case), atol=tolerance(case))
        # into the layer's output buffer: its first rows (the step's; padding rows after
        # them untouched), and a strided one
        buffer = torch.full((len(layer_query) + 3, *layer_query.shape[1:]), 7.0,
                            dtype=layer_query.dtype)
        written = attend_segments(layer_query, layer_cache, plan, scale,
                                  buffer[:len(layer_query)])
        assert written.data_ptr() == buffer.data_ptr()
        torch.testing.assert_close(buffer[:len(layer_query)].float(), want.float(),
                                   rtol=tolerance(case), atol=tolerance(case))
        assert bool((buffer[len(layer_query):] == 7.0).all())
        strided = torch.zeros(*layer_query.shape[:2], 2 * layer_query.shape[2],
                              dtype=layer_query.dtype)[..., ::2]
        attend_segments(layer_query, layer_cache, plan, scale, strided)
        torch.testing.assert_close(strided.float(), want.float(), rtol=tolerance(case),
                                   atol=tolerance(case))


def test_split_pages_hold_what_was_written():
    """Keys and values written at their slots are read back at their positions, and the
    split arrangement is the interleaved one's content (``to_split``)."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(3, 2, 16, 2 * 8)
    key, value = torch.randn(20, 2, 8, generator=gen), torch.randn(20, 2, 8, generator=gen)
    slots = torch.randperm(48, generator=gen)[:20]
    slots[3] = -1  # not stored
    write_kv(cache, key, value, slots)
    keys, values = key_value_views(cache)
    stored = slots >= 0
    pages, offsets = slots[stored] // 16, slots[stored] % 16
    assert torch.equal(keys[pages, :, offsets], key[stored])
    assert torch.equal(values[pages, :, offsets], value[stored])
    interleaved = torch.randn(3, 2, 16, 16, generator=gen)
    split_keys, split_values = key_value_views(to_split(interleaved))
    assert torch.equal(split_keys, interleaved[..., :8])
    assert torch.equal(split_values, interleaved[..., 8:])


# (pages, KV heads, page size, head size, rows written, dtype)
WRITE_GRID = {
    "page-16-one-row": (4, 2, 16, 64, 1, torch.float32),
    "page-16-many-rows": (6, 2, 16, 64, 70, torch.float32),
    "page-32-bf16": (5, 4, 32, 64, 100, torch.bfloat16),
    "page-64-head-128": (3, 1, 64, 128, 150, torch.float32),
}


@pytest.mark.parametrize("case", WRITE_GRID.values(), ids=WRITE_GRID.keys())
def test_vllm_cache_write_equals_write_kv(case):
    """vLLM's cache-write kernel stores what ``write_kv`` stores, skipping negative slots,
    from float32 rows into a cache of another dtype too."""
    pages, heads, page_size, head_size, rows, dtype = case
    gen = torch.Generator().manual_seed(rows)
    want = torch.randn(pages, heads, page_size, 2 * head_size, generator=gen).to(dtype)
    got = want.clone()
    key = torch.randn(rows, heads, head_size, generator=gen)
    value = torch.randn(rows, heads, head_size, generator=gen)
    slots = torch.randperm(pages * page_size, generator=gen)[:rows]
    slots[::7] = -1
    write_kv(want, key, value, slots)
    write_kv_with_vllm(got, key, value, slots)
    assert torch.equal(got, want)


def test_rows_of_a_request_out_of_block_order():
    """One request's rows whose blocks interleave form one segment per run of a block."""
    query, kv_cache, _, _, _, table, block, scale = torch_side(
        make_case([(0, 10, 1)], [16], 4, 16, 4, 2, 64, torch.float32, False, "cpu"))
    positions = torch.tensor([8, 9, 10, 11, 4, 5, 6, 7, 12, 13])
    args = (query, kv_cache, positions, [0, 10], [16], table, block, scale)
    torch.testing.assert_close(segmented_block_causal_attention(*args),
                               block_causal_attention(*args), rtol=1e-5, atol=1e-5)
