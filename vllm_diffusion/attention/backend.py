"""vLLM attention backend for block-diffusion steps.

The diffusion runner builds ``BlockDiffusionMetadata`` itself for every step (one object
shared by all layers); the backend stores this step's keys/values at the given slots and
runs block-causal attention over each request's paged KV: the Triton kernel on CUDA, the
vectorised torch version elsewhere; both have the signature of the torch reference
(``block_attention.block_causal_attention``) and are tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from vllm_diffusion.attention import block_attention
from vllm_diffusion.attention.block_attention import write_kv
from vllm_diffusion.attention.eviction import EVICTION_LAYER, EvictionStep
from vllm_diffusion.attention.importance import ImportanceProbe, layer_index


@dataclass
class BlockDiffusionMetadata:
    num_actual_tokens: int
    query_positions: torch.Tensor  # [T] absolute positions of the query rows
    slot_mapping: torch.Tensor  # [T] KV slot of each row, -1 = not stored
    block_table: torch.Tensor  # [R, max_pages] page ids per request
    query_start_loc: list[int]  # R + 1 row offsets per request (host)
    kv_lens: list[int]  # R: keys [0, kv_len) are visible to request r (host)
    diffusion_block_size: int
    importance: ImportanceProbe | None = None  # set when candidates' importance is wanted
    eviction: EvictionStep | None = None  # set for FOCUS steps

    def compact(self, keep_rows: torch.Tensor, keep: torch.Tensor) -> None:
        """Keep only the query rows ``keep_rows`` (``keep``: [T] bool, host) from here on."""
        self.query_positions = self.query_positions[keep_rows]
        self.slot_mapping = self.slot_mapping[keep_rows]
        counts = [int(keep[a:b].sum()) for a, b in
                  zip(self.query_start_loc[:-1], self.query_start_loc[1:])]
        self.query_start_loc = [0]
        for count in counts:
            self.query_start_loc.append(self.query_start_loc[-1] + count)
        self.num_actual_tokens = len(keep_rows)


def attention_kernel(device: torch.device):
    """The block-causal attention implementation for tensors on ``device``."""
    if device.type == "cuda":
        from vllm_diffusion.attention import triton_block_attention

        return triton_block_attention.block_causal_attention
    return block_attention.padded_block_causal_attention


class BlockDiffusionAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["BlockDiffusionAttentionImpl"]:
        return BlockDiffusionAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["BlockDiffusionMetadataBuilder"]:
        return BlockDiffusionMetadataBuilder

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any


class BlockDiffusionMetadataBuilder(AttentionMetadataBuilder[BlockDiffusionMetadata]):
    """vLLM instantiates a builder per backend; diffusion steps never use it."""

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int,
              common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> BlockDiffusionMetadata:
        raise NotImplementedError(
            "block-diffusion attention metadata is built by the diffusion model runner")


class BlockDiffusionAttentionImpl(AttentionImpl[BlockDiffusionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes=None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **unused) -> None:
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise NotImplementedError(
                "block-diffusion attention supports no alibi, sliding window or soft cap")
        if kv_cache_dtype != "auto":
            raise NotImplementedError("block-diffusion attention needs kv_cache_dtype=auto")
        self.kv_cache_dtype = kv_cache_dtype
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.layer_index: int | None = None

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: BlockDiffusionMetadata | None, output: torch.Tensor,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if attn_metadata is None:  # vLLM's profiling runs carry no metadata
            return output.zero_()
        if self.layer_index is None:
            self.layer_index = layer_index(layer.layer_name)
        md = attn_metadata
        n = md.num_actual_tokens
        if md.importance is not None:
            md.importance.observe(layer.layer_name, query[:n], key[:n], self.scale)
        write_kv(kv_cache, key[:n], value[:n], md.slot_mapping)
        rows = slice(0, n)
        if md.eviction is not None and self.layer_index == EVICTION_LAYER:
            # Every processed row has stored its layer-1 KV; from here on only kept rows.
            md.eviction.select(md)
            if md.eviction.keep_rows is not None:
                output[:n].zero_()
                rows = md.eviction.keep_rows
        output[rows] = attention_kernel(query.device)(
            query[rows], kv_cache, md.query_positions, md.query_start_loc, md.kv_lens,
            md.block_table, md.diffusion_block_size, self.scale)
        return output
