"""vLLM attention backend for block-diffusion steps. Each layer reads a read-only view of
the step's rows (``BlockDiffusionMetadata``) that the rows' owner publishes in the forward
context (docs/models.md, "The model contract"), stores its key rows' keys/values and runs
block-causal attention for its query rows (Triton on CUDA, ``kernels.dispatch``; vLLM's
CPU kernel on CPU, ``cpu_attention``), optionally with a key selection (``key_selection``).
It changes nothing but its outputs: the attention output and, for a key selection with
scoring requests, the view's ``selected_prefix`` slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

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
                                                   kept_pages_attention, plan_segments,
                                                   segmented_block_causal_attention,
                                                   write_kv_with_vllm)
from vllm_diffusion.attention.key_selection import attend_with_key_selection, score_prefixes
from vllm_diffusion.kernels.block_attention import (PaddedPlan, attend_padded,
                                                    padded_block_causal_attention,
                                                    plan_padded_attention, write_kv)
from vllm_diffusion.kernels.dispatch import kernel
from vllm_diffusion.step.keys import KeySelection, SelectedPrefix
from vllm_diffusion.step.rows import StepRows

logger = init_logger(__name__)


@dataclass(frozen=True, slots=True)
class BlockDiffusionMetadata:
    """What one layer's attention reads: a read-only view of the step's rows at that
    layer, made by the rows' owner (the attention never changes it)."""

    query_positions: torch.Tensor  # [T] absolute positions of the query rows
    slot_mapping: torch.Tensor  # [T_kv] KV slot of each key row stored, -1 = not stored
    query_start_loc: tuple[int, ...]  # R + 1 query row offsets per request (host)
    kv_lens: tuple[int, ...]  # R: keys [0, kv_len) are visible to request r (host)
    block_table: torch.Tensor  # [R, max_pages] page ids per request
    diffusion_block_size: int
    # The CPU attention's plan for these query rows (``plan_step``), made once by the
    # owner for the layers that share them; None: none made, the attention plans its call
    attention_plan: Any = None
    key_selection: KeySelection | None = None  # this layer's (None: dense)
    # Output slot of a key selection with scoring requests: the attention puts in it what
    # it selected for each (request index -> [H_sel, keep] int64); None without scoring
    selected_prefix: SelectedPrefix | None = None

    @classmethod
    def of(cls, rows: StepRows, block_table: torch.Tensor,
           diffusion_block_size: int) -> BlockDiffusionMetadata:
        """A view of the rows as they are now (``StepRows`` replaces, never changes, its
        fields, so the view keeps them)."""
        return cls(rows.query_positions, rows.slot_mapping, tuple(rows.query_start_loc),
                   tuple(rows.kv_lens), block_table, diffusion_block_size)

    def with_attention_plan(self, attention_plan: Any) -> BlockDiffusionMetadata:
        """This view with the CPU attention's plan for its rows (``plan_step``)."""
        return BlockDiffusionMetadata(
            self.query_positions, self.slot_mapping, self.query_start_loc, self.kv_lens,
            self.block_table, self.diffusion_block_size, attention_plan, self.key_selection,
            self.selected_prefix)

    def with_key_selection(self, key_selection: KeySelection,
                           selected_prefix: SelectedPrefix | None) -> BlockDiffusionMetadata:
        """This view for a layer with a key selection (and its output slot)."""
        # the constructor, not ``dataclasses.replace``: this runs at every such layer
        return BlockDiffusionMetadata(
            self.query_positions, self.slot_mapping, self.query_start_loc, self.kv_lens,
            self.block_table, self.diffusion_block_size, self.attention_plan, key_selection,
            selected_prefix)

    @property
    def num_queries(self) -> int:
        return len(self.query_positions)


def attention_planner(attention_layer: torch.nn.Module
                      ) -> Callable[[BlockDiffusionMetadata], Any]:
    """The step-fixed attention plan for a view's rows, made with ``attention_layer``
    (one of the model's block-diffusion ``Attention`` layers: every layer has the same
    heads and cache shape, so one layer's plan serves all)."""
    return lambda view: attention_layer.impl.plan_step(view, attention_layer.kv_cache)


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
        # padded torch path; planned once per step by the rows' owner (``plan_step``) and
        # attended per layer, or in one call (``cpu_dense``) for a view without a plan and
        # for the dense rows of a step with a key selection.
        self.cpu_attention = (plan_segments, attend_segments)
        self.cpu_dense = segmented_block_causal_attention
        # the key-sparse attention (Sparse-dLLM): vLLM's kernel over each request's store
        self.cpu_sparse = kept_pages_attention
        # the KV write: vLLM's CPU kernel where its attention runs, else the torch path
        self.write_kv = write_kv_with_vllm if current_platform.is_cpu() else write_kv
        if current_platform.is_cpu() and not cpu_kernel_supports(head_size):
            logger.info("vllm-diffusion: vLLM's CPU attention has no kernel for head size "
                        "%d; the padded torch attention runs instead", head_size)
            self.cpu_attention = (self._plan_padded, attend_padded)
            self.cpu_dense = padded_block_causal_attention
            self.cpu_sparse = kernel("sparse_prefix_attention", torch.device("cpu"))
            self.write_kv = write_kv

    def _plan_padded(self, query_positions, query_start_loc, kv_lens, block_table,
                     block_size, num_heads, kv_cache) -> PaddedPlan:
        return plan_padded_attention(query_positions, query_start_loc, kv_lens, block_table,
                                     block_size, kv_cache.shape[2],
                                     num_heads // self.num_kv_heads)

    def plan_step(self, view: BlockDiffusionMetadata, kv_cache: torch.Tensor) -> Any:
        """The step-fixed part of this attention for the view's query rows, which serves
        every layer while they stay (``BlockDiffusionMetadata.attention_plan``); None on
        CUDA, whose kernel needs none."""
        if kv_cache.device.type == "cuda":
            return None
        plan, _ = self.cpu_attention
        return plan(view.query_positions, view.query_start_loc, view.kv_lens,
                    view.block_table, view.diffusion_block_size, self.num_heads, kv_cache)

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: BlockDiffusionMetadata | None, output: torch.Tensor,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        """query [T(+padding), H, D]; key, value [T_kv(+padding), H_kv, D]; writes and
        returns output [T(+padding), H, D]."""
        if attn_metadata is None:  # vLLM's profiling runs carry no metadata
            return output.zero_()
        view = attn_metadata
        n, n_kv = view.num_queries, len(view.slot_mapping)
        if n < len(output):
            output[n:].zero_()  # rows past the step's: bucket padding (``StepRun``)
        # the step's rows (no slicing where there is no padding: this runs per layer)
        query_rows, output_rows = _first(query, n), _first(output, n)
        self.write_kv(kv_cache, _first(key, n_kv), _first(value, n_kv), view.slot_mapping)
        on_cuda = query.device.type == "cuda"
        block_table, block_size = view.block_table, view.diffusion_block_size
        selection = view.key_selection
        if selection is None:
            if on_cuda:
                output_rows[:] = kernel("block_attention", query.device)(
                    query_rows, kv_cache, view.query_positions, view.query_start_loc,
                    view.kv_lens, block_table, block_size, self.scale)
            elif view.attention_plan is not None:
                self.cpu_attention[1](query_rows, kv_cache, view.attention_plan, self.scale,
                                      output_rows)
            else:
                output_rows[:] = self.cpu_dense(query_rows, kv_cache, view.query_positions,
                                                view.query_start_loc, view.kv_lens,
                                                block_table, block_size, self.scale)
            return output
        dense = kernel("block_attention", query.device) if on_cuda else self.cpu_dense
        sparse = (kernel("sparse_prefix_attention", query.device) if on_cuda
                  else self.cpu_sparse)
        tp_size = get_tensor_model_parallel_world_size()
        sum_heads = tensor_model_parallel_all_reduce if tp_size > 1 else None
        if selection.scoring:
            if view.selected_prefix is None:
                raise ValueError("a key selection with scoring requests needs an output "
                                 "slot (BlockDiffusionMetadata.selected_prefix)")
            view.selected_prefix.update(score_prefixes(
                query_rows, kv_cache, view.query_start_loc, block_table, selection,
                self.scale, sum_heads, self.num_heads * tp_size, view.kv_lens))
        output_rows[:] = attend_with_key_selection(
            query_rows, kv_cache, view, block_table, block_size, selection, self.scale,
            dense, sparse)
        return output


def _first(rows: torch.Tensor, n: int) -> torch.Tensor:
    """rows[:n], without a new view where that is all of them."""
    return rows if len(rows) == n else rows[:n]
