"""The decoder stack of every model the project registers, with the policy's hooks.

``run_decoder_stack`` runs a model's layers one by one, as Qwen3's ``Qwen2Model.forward``
does (embedding, pre-norm residual layers, final norm), and calls the step's hooks
(``policies.base.StepHooks``) at the layers they declare:

- ``before_attention``: after the layer's queries, keys and values are computed and
  before its attention. The attention still stores the keys/values of every row; only
  the rows the hook keeps are attended for and continue to later layers;
- ``select_keys``: the layer's prefix sparsity (which prefix keys each request's block
  rows see, and which requests select them this step), handed to the attention;
- ``after_output``: after the layer's output (the residual stream: attention and MLP
  added), which the hook reads; the rows the hook keeps continue.

Dropped rows leave the step's attention metadata too (``BlockDiffusionMetadata``). The
step rows of the returned hidden states are left in ``StackRun.rows``, the block rows
each layer computed in ``StackRun.layer_block_rows``. Without a ``StackRun`` (a step with
no hooks) the stack is plain layers, which vLLM may compile.
"""

from __future__ import annotations

import dataclasses
from itertools import islice

import torch
import torch.nn as nn

from vllm.forward_context import get_forward_context, is_forward_context_available

from vllm_diffusion.attention.compaction import compaction_kernel
from vllm_diffusion.policies.base import LayerHooks, LayerInput, RowSelection, StepHooks

_NO_HOOKS = LayerHooks()


@dataclasses.dataclass
class StackRun:
    """One forward of a diffusion step: its hooks in, its surviving rows out."""

    hooks: StepHooks
    block_rows: torch.Tensor  # [T] bool (host): the step's block rows
    rows: torch.Tensor | None = None  # [T'] step rows of the output hidden states (host)
    layer_block_rows: list[int] = dataclasses.field(default_factory=list)  # per layer


def _step_metadata(model: nn.Module):
    """The step's attention metadata (one object shared by every layer), or None in
    vLLM's profiling and dummy runs."""
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        layer = model.layers[model.start_layer]
        metadata = metadata.get(layer.self_attn.attn.layer_name)
    return metadata


def run_decoder_stack(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                      run: StackRun | None) -> torch.Tensor:
    hooks = run.hooks if run is not None else None
    declared = hooks.layers if hooks is not None else _NO_HOOKS
    metadata = _step_metadata(model) if hooks is not None else None
    if hooks is not None and metadata is None:
        raise RuntimeError("policy hooks need the block-diffusion attention metadata")
    hidden = model.embed_input_ids(input_ids)
    residual = None
    rows = torch.arange(hidden.shape[0]) if hooks is not None else None
    block_count = int(run.block_rows.sum()) if hooks is not None else 0
    for index, layer in enumerate(islice(model.layers, model.start_layer, model.end_layer),
                                  start=model.start_layer):
        if residual is None:
            residual = hidden
            hidden = layer.input_layernorm(hidden)
        else:
            hidden, residual = layer.input_layernorm(hidden, residual)
        attention = layer.self_attn
        q, k, v = attention.project(positions, hidden)
        selection = None
        if index in declared.before_attention or index in declared.select_keys:
            layer_input = LayerInput(
                index, rows, query=q.view(-1, attention.num_heads, attention.head_dim),
                key=k.view(-1, attention.num_kv_heads, attention.head_dim),
                scale=attention.scaling)
            if index in declared.select_keys:
                metadata.prefix_sparsity = hooks.select_keys(layer_input)
            if index in declared.before_attention:
                selection = hooks.before_attention(layer_input)
        if selection is not None:
            keep_rows = torch.nonzero(selection.keep).flatten()
            metadata.keep_queries(selection.keep, selection.kv_lens or {})
            device_rows = keep_rows.to(q.device)
            q = q[device_rows]
            residual, _ = compaction_kernel(residual.device)(residual, None, device_rows)
            positions = positions[..., device_rows]
            rows = rows[keep_rows]
            block_count = int(run.block_rows[rows].sum())
        if hooks is not None:
            run.layer_block_rows.append(block_count)
        hidden = attention.attend(q, k, v)
        if selection is not None:
            metadata.keep_keys(selection.keep)
        if metadata is not None:
            metadata.prefix_sparsity = None
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.mlp(hidden)
        if index in declared.after_output:
            selection = hooks.after_output(LayerInput(index, rows, hidden=hidden + residual))
            if selection is not None:
                hidden, residual, positions, rows = _drop_rows(
                    selection, metadata, hidden, residual, positions, rows)
                block_count = int(run.block_rows[rows].sum())
    hidden, _ = model.norm(hidden, residual)
    if run is not None:
        run.rows = rows
    return hidden


def _drop_rows(selection: RowSelection, metadata, hidden: torch.Tensor,
               residual: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor):
    keep_rows = torch.nonzero(selection.keep).flatten()
    metadata.keep_queries(selection.keep, selection.kv_lens or {})
    metadata.keep_keys(selection.keep)
    device_rows = keep_rows.to(hidden.device)
    hidden, residual = compaction_kernel(hidden.device)(hidden, residual, device_rows)
    return hidden, residual, positions[..., device_rows], rows[keep_rows]
