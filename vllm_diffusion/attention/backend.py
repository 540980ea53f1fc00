"""vLLM attention backend for block-diffusion steps.

The diffusion runner builds ``BlockDiffusionMetadata`` itself for every step (one object
shared by all layers); the backend stores the keys/values of every key row at the given
slots and runs block-causal attention for the query rows over each request's paged KV:
the Triton kernel on CUDA, the vectorised torch version elsewhere; both have the signature
of the torch reference (``block_attention.block_causal_attention``) and are tested
against it. The decoder stack may drop query rows at a layer (``keep_queries``: that
layer still stores every row's keys/values) and then key rows (``keep_keys``), and may
restrict, for one layer, the prefix keys that requests' block rows see
(``prefix_sparsity``: kept-index lists, ``sparse_prefix``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.distributed import (get_tensor_model_parallel_world_size,
                              tensor_model_parallel_all_reduce)
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from vllm_diffusion.attention import block_attention
from vllm_diffusion.attention.block_attention import write_kv
from vllm_diffusion.attention.sparse_prefix import (PrefixSparsity,
                                                    attend_with_prefix_sparsity,
                                                    gathered_sparse_prefix_attention)


@dataclass
class BlockDiffusionMetadata:
    num_actual_tokens: int  # query rows
    query_positions: torch.Tensor  # [T] absolute positions of the query rows
    slot_mapping: torch.Tensor  # [T_kv] KV slot of each key row, -1 = not stored
    block_table: torch.Tensor  # [R, max_pages] page ids per request
    query_start_loc: list[int]  # R + 1 row offsets per request (host)
    kv_lens: list[int]  # R: keys [0, kv_len) are visible to request r (host)
    diffusion_block_size: int
    # the current layer's kept prefix positions per request (None: dense attention)
    prefix_sparsity: PrefixSparsity | None = None

    def keep_queries(self, keep: torch.Tensor, kv_lens: dict[int, int]) -> None:
        """Keep the query rows where ``keep`` ([T] bool, host) is set, and give the named
        requests new key lengths; key rows are unchanged until ``keep_keys``."""
        keep_rows = torch.nonzero(keep).flatten().to(self.query_positions.device)
        self.query_positions = self.query_positions[keep_rows]
        counts = [int(keep[a:b].sum()) for a, b in
                  zip(self.query_start_loc[:-1], self.query_start_loc[1:])]
        self.query_start_loc = [0]
        for count in counts:
            self.query_start_loc.append(self.query_start_loc[-1] + count)
        self.num_actual_tokens = len(keep_rows)
        for request, kv_len in kv_lens.items():
            self.kv_lens[request] = kv_len

    def keep_keys(self, keep: torch.Tensor) -> None:
        """Keep the key rows where ``keep`` ([T_kv] bool, host) is set."""
        self.slot_mapping = self.slot_mapping[torch.nonzero(keep).flatten()
                                              .to(self.slot_mapping.device)]


def attention_kernel(device: torch.device):
    """The block-causal attention implementation for tensors on ``device``."""
    if device.type == "cuda":
        from vllm_diffusion.attention import triton_block_attention

        return triton_block_attention.block_causal_attention
    return block_attention.padded_block_causal_attention


def sparse_prefix_kernel(device: torch.device):
    """The prefix-sparse attention implementation for tensors on ``device``."""
    if device.type == "cuda":
        from vllm_diffusion.attention import triton_sparse_prefix

        return triton_sparse_prefix.sparse_prefix_attention
    return gathered_sparse_prefix_attention


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

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: BlockDiffusionMetadata | None, output: torch.Tensor,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if attn_metadata is None:  # vLLM's profiling runs carry no metadata
            return output.zero_()
        md = attn_metadata
        n, n_kv = md.num_actual_tokens, len(md.slot_mapping)
        write_kv(kv_cache, key[:n_kv], value[:n_kv], md.slot_mapping)
        dense = attention_kernel(query.device)
        if md.prefix_sparsity is None:
            output[:n] = dense(query[:n], kv_cache, md.query_positions, md.query_start_loc,
                               md.kv_lens, md.block_table, md.diffusion_block_size, self.scale)
            return output
        tp_size = get_tensor_model_parallel_world_size()
        output[:n] = attend_with_prefix_sparsity(
            query[:n], kv_cache, md, md.prefix_sparsity, self.scale, dense,
            sparse_prefix_kernel(query.device),
            sum_heads=tensor_model_parallel_all_reduce if tp_size > 1 else None,
            total_heads=self.num_heads * tp_size)
        return output
