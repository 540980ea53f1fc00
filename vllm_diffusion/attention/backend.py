"""vLLM attention backend for block-diffusion steps.

The diffusion runner builds ``BlockDiffusionMetadata`` itself for every step (one object
shared by all layers); the backend stores the keys/values of every key row at the given
slots and runs block-causal attention for the query rows over each request's paged KV
(the Triton kernel on CUDA through ``kernels.dispatch``; vLLM's own CPU attention kernel
on CPU, ``cpu_attention``; both have the signature of the torch reference and are tested
against it). The rows it
reads are the step's current ones (``step.rows.StepRows``): a hook may have dropped query
rows at this layer (the layer still stores every row's keys/values), and may have
restricted the prefix keys that requests' block rows see (``key_selection``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.distributed import (get_tensor_model_parallel_world_size,
                              tensor_model_parallel_all_reduce)
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_diffusion.attention.cpu_attention import (attend_segments, cpu_kernel_supports,
                                                   plan_segments,
                                                   segmented_block_causal_attention,
                                                   write_kv_with_vllm)
from vllm_diffusion.attention.key_selection import attend_with_key_selection
from vllm_diffusion.kernels.block_attention import (PaddedPlan, attend_padded,
                                                    padded_block_causal_attention,
                                                    plan_padded_attention, write_kv)
from vllm_diffusion.kernels.dispatch import kernel
from vllm_diffusion.step.rows import StepRows

logger = init_logger(__name__)


@dataclass(frozen=True)
class BlockDiffusionMetadata:
    """One step's attention metadata, shared by every layer; the rows computed now live in
    ``rows``, which the step's run object narrows when a hook drops rows."""

    rows: StepRows
    block_table: torch.Tensor  # [R, max_pages] page ids per request
    diffusion_block_size: int


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

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # vLLM's portable CPU attention kernels take pages of a multiple of 16 positions.
        return [MultipleOf(16)] if current_platform.is_cpu() else [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...] | None:
        # On CPU, vLLM's CPU attention kernel reads head-major pages (as vLLM's own CPU
        # backend asks); the Triton kernels take any strides.
        return (KVCacheLayout.LBHNC,) if current_platform.is_cpu() else None

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
        # CPU: vLLM's CPU attention kernel where it has one for the head size, else the
        # padded torch path; planned once per step (``StepRows.attention_plan``) and
        # attended per layer, or in one call (``cpu_dense``) for the dense rows of a step
        # with a key selection.
        self.cpu_attention = (plan_segments, attend_segments)
        self.cpu_dense = segmented_block_causal_attention
        # the KV write: vLLM's CPU kernel where its attention runs, else the torch path
        self.write_kv = write_kv_with_vllm if current_platform.is_cpu() else write_kv
        if current_platform.is_cpu() and not cpu_kernel_supports(head_size):
            logger.info("vllm-diffusion: vLLM's CPU attention has no kernel for head size "
                        "%d; the padded torch attention runs instead", head_size)
            self.cpu_attention = (self._plan_padded, attend_padded)
            self.cpu_dense = padded_block_causal_attention
            self.write_kv = write_kv

    def _plan_padded(self, query_positions, query_start_loc, kv_lens, block_table,
                     block_size, num_heads, kv_cache) -> PaddedPlan:
        return plan_padded_attention(query_positions, query_start_loc, kv_lens, block_table,
                                     block_size, kv_cache.shape[2],
                                     num_heads // self.num_kv_heads)

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: BlockDiffusionMetadata | None, output: torch.Tensor,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if attn_metadata is None:  # vLLM's profiling runs carry no metadata
            return output.zero_()
        rows = attn_metadata.rows
        n, n_kv = rows.num_queries, len(rows.slot_mapping)
        output[n:].zero_()  # rows past the step's: bucket padding (``StepRun``)
        self.write_kv(kv_cache, key[:n_kv], value[:n_kv], rows.slot_mapping)
        rows.finish_attention()  # rows dropped before this attention leave the key rows
        on_cuda = query.device.type == "cuda"
        block_table, block_size = attn_metadata.block_table, attn_metadata.diffusion_block_size
        if rows.key_selection is None:
            if on_cuda:
                output[:n] = kernel("block_attention", query.device)(
                    query[:n], kv_cache, rows.query_positions, rows.query_start_loc,
                    rows.kv_lens, block_table, block_size, self.scale)
                return output
            plan, attend = self.cpu_attention
            if rows.attention_plan is None:  # at the step's first layer, or after a drop
                rows.attention_plan = plan(rows.query_positions, rows.query_start_loc,
                                           rows.kv_lens, block_table, block_size,
                                           self.num_heads, kv_cache)
            output[:n] = attend(query[:n], kv_cache, rows.attention_plan, self.scale)
            return output
        dense = kernel("block_attention", query.device) if on_cuda else self.cpu_dense
        tp_size = get_tensor_model_parallel_world_size()
        output[:n] = attend_with_key_selection(
            query[:n], kv_cache, rows, block_table, block_size, rows.key_selection, self.scale,
            dense, kernel("sparse_prefix_attention", query.device),
            sum_heads=tensor_model_parallel_all_reduce if tp_size > 1 else None,
            total_heads=self.num_heads * tp_size)
        return output
