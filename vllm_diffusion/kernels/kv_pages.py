"""How a layer's paged KV cache [num_pages, H_kv, page_size, 2 * D] holds its keys and
values on each device: interleaved on CUDA (key of page offset ``o`` at ``[.., o, :D]``,
its value at ``[.., o, D:]``), split on CPU (per page and KV head, the page's keys
transposed, [D, page_size], then its values, [page_size, D]: what vLLM's CPU attention
reads). Every torch reader and writer goes through ``key_value_views``; docs/kernels.md.
"""

from __future__ import annotations

import torch


def is_split(kv_cache: torch.Tensor) -> bool:
    """Whether ``kv_cache`` holds the split arrangement: every cache off CUDA."""
    return kv_cache.device.type != "cuda"


def key_value_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's keys and values, two [num_pages, H_kv, page_size, D] views."""
    num_pages, num_kv_heads, page_size, two_d = kv_cache.shape
    head_size = two_d // 2
    if not is_split(kv_cache):
        return kv_cache[..., :head_size], kv_cache[..., head_size:]
    if not kv_cache.is_contiguous():
        raise ValueError("a CPU KV cache must be contiguous [num_pages, H_kv, page_size, 2D] "
                         f"(got strides {kv_cache.stride()})")
    halves = kv_cache.view(num_pages, num_kv_heads, 2, page_size * head_size)
    keys = halves[:, :, 0].view(num_pages, num_kv_heads, head_size, page_size).transpose(2, 3)
    values = halves[:, :, 1].view(num_pages, num_kv_heads, page_size, head_size)
    return keys, values


def to_split(kv_cache: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy, in the split arrangement, of an interleaved cache (any
    strides; its key of page offset o at [.., o, :D])."""
    head_size = kv_cache.shape[-1] // 2
    split = torch.empty(kv_cache.shape, dtype=kv_cache.dtype)
    keys, values = key_value_views(split)
    keys.copy_(kv_cache[..., :head_size].cpu())
    values.copy_(kv_cache[..., head_size:].cpu())
    return split


def interleaved_as_read_here(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache that the torch code on ``kv_cache``'s device reads as holding what the
    interleaved ``kv_cache`` holds (for comparisons with the Triton kernels, which read the
    interleaved arrangement, under Triton's interpreter too)."""
    return to_split(kv_cache) if is_split(kv_cache) else kv_cache
