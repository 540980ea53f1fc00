"""The model contract: a diffusion step's run (``StepRun``), whose hook points a family's
layer halves call, and the read-only view of the step's rows each layer's attention reads
(``LayerViews``). The hook points, their order and the views' rules:
docs/models.md, "The model contract"."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from vllm_diffusion.attention.backend import BlockDiffusionMetadata
from vllm_diffusion.kernels.dispatch import kernel
from vllm_diffusion.step.hooks import LayerInput, RowSelection, StepHooks
from vllm_diffusion.step.keys import SelectedPrefix
from vllm_diffusion.step.rows import StepRows


class LayerViews:
    """What each layer's attention reads in a step: ``by_name``, the forward context's
    metadata (attention layer name -> its read-only view), which the rows' owner fills."""

    def __init__(self, layer_names: Sequence[str], block_table: torch.Tensor,
                 diffusion_block_size: int,
                 planner: Callable[[BlockDiffusionMetadata], Any] | None) -> None:
        self.layer_names = layer_names  # the attention layers, by layer index
        self.block_table = block_table  # [R, max_pages] page ids per request
        self.diffusion_block_size = diffusion_block_size
        self.planner = planner  # the attention's step-fixed plan for a view's rows
        self.by_name: dict[str, BlockDiffusionMetadata] = {}

    def view(self, rows: StepRows, planned: bool) -> BlockDiffusionMetadata:
        """A view of the rows as they are now; ``planned``: with the attention's plan (for
        views that some layer attends densely with)."""
        view = BlockDiffusionMetadata.of(rows, self.block_table, self.diffusion_block_size)
        plan = self.planner(view) if planned and self.planner is not None else None
        return view if plan is None else view.with_attention_plan(plan)

    def publish(self, view: BlockDiffusionMetadata, first_layer: int,
                end_layer: int | None = None) -> None:
        """``view`` for the layers [first_layer, end_layer) (to the last by default)."""
        for name in self.layer_names[first_layer:end_layer]:
            self.by_name[name] = view


def publish_preselected_keys(hooks: StepHooks, step_rows: StepRows,
                             views: LayerViews) -> dict[int, SelectedPrefix]:
    """The views of a step whose hooks only preselect keys (the model runs whole): one view
    of the rows, a preselecting layer's with its key selection and, where it has scoring
    requests, an output slot. Returns those slots by layer, for ``hand_selected``."""
    declared = hooks.layers
    selections = {layer: hooks.preselected_keys(layer) for layer in declared.preselect_keys}
    selections = {layer: s for layer, s in selections.items() if s is not None}
    dense = views.view(step_rows, planned=len(selections) < len(views.layer_names))
    views.publish(dense, 0)
    slots: dict[int, SelectedPrefix] = {}
    for layer, selection in selections.items():
        slot: SelectedPrefix | None = {} if selection.scoring else None
        if slot is not None:
            slots[layer] = slot
        views.publish(dense.with_key_selection(selection, slot), layer, layer + 1)
    return slots


def hand_selected(hooks: StepHooks, slots: dict[int, SelectedPrefix]) -> None:
    """After the forward of ``publish_preselected_keys``' views: what each preselecting
    layer's attention selected goes to the hooks, layer by layer."""
    for layer in sorted(slots):
        hooks.after_key_scoring(layer, slots[layer])


class StepRun:
    """One forward of a diffusion step with hooks: the hooks in, its surviving rows out;
    owns the step's rows and publishes each layer's view of them."""

    def __init__(self, hooks: StepHooks, block_rows: torch.Tensor, step_rows: StepRows,
                 views: LayerViews, compiled: bool = False,
                 row_buckets: tuple[int, ...] | None = None) -> None:
        self.hooks = hooks
        # Row counts the continuing rows are padded to after a drop (None: no padding);
        # the padding rows follow the real ones, which ``rows`` lists
        self.row_buckets = row_buckets
        self.padding_rows = 0  # padding rows added, summed over the drops
        # Whether the layers between hook points run as compiled pieces (``layer_segments``)
        self.compiled = compiled
        self.declared = hooks.layers
        self.block_rows = block_rows  # [T] bool (host): the step's block rows
        self.step_rows = step_rows  # the rows now; the attention reads views of them
        self.views = views
        self.rows = torch.arange(len(block_rows))  # [T'] step rows of the current states
        self.layer_block_rows: list[int] = []  # per layer
        self._block_count = int(block_rows.sum())
        num_layers = len(views.layer_names)
        selecting = {*self.declared.select_keys, *self.declared.preselect_keys}
        # the preselecting layers' key selections, made before the forward
        self._preselected = {layer: hooks.preselected_keys(layer)
                             for layer in self.declared.preselect_keys}
        # The last layer whose attention is dense for sure: views for it and the layers
        # before it carry the attention's plan (a layer with a key selection plans none)
        self._last_dense_layer = max(
            (layer for layer in range(num_layers) if layer not in selecting), default=-1)
        self._view = views.view(step_rows, planned=self._last_dense_layer >= 0)
        views.publish(self._view, 0)  # every layer reads it until a hook narrows the rows
        self._selected: tuple[int, SelectedPrefix] | None = None  # (layer, its slot)

    def before_attention(self, layer: int, attention: nn.Module, q: torch.Tensor,
                         k: torch.Tensor, *carried: torch.Tensor
                         ) -> tuple[torch.Tensor, ...]:
        """q [T', H * D], k [T', H_kv * D]; returns (q, *carried) of the continuing rows."""
        declared, key_selection, selection = self.declared, None, None
        real = len(self.rows)  # rows beyond it are bucket padding
        if layer in declared.before_attention or layer in declared.select_keys:
            layer_input = LayerInput(
                layer, self.rows,
                query=q[:real].view(-1, attention.num_heads, attention.head_dim),
                key=k[:real].view(-1, attention.num_kv_heads, attention.head_dim),
                scale=attention.scaling)
            if layer in declared.select_keys:
                key_selection = self.hooks.select_keys(layer_input)
            if layer in declared.before_attention:
                selection = self.hooks.before_attention(layer_input)
        if layer in self._preselected:
            key_selection = self._preselected[layer]
            if key_selection is not None and len(self.rows) != len(self.block_rows):
                # made for the step's rows before the forward: it indexes them
                raise ValueError(f"a preselected key selection at layer {layer} after a "
                                 f"hook dropped rows; select those keys with select_keys")
        view = self._view
        if selection is not None:
            entering_keys = self.step_rows.slot_mapping
            self._narrow(selection, layer, attending_from=layer)
            # this layer's attention still stores the keys of every row that entered it
            view = dataclasses.replace(self._view, slot_mapping=entering_keys)
            q, *carried = self._keep(selection, q[:real], *(self._real(t) for t in carried))
        if key_selection is not None:
            slot: SelectedPrefix | None = {} if key_selection.scoring else None
            self._selected = None if slot is None else (layer, slot)
            view = view.with_key_selection(key_selection, slot)
        if view is not self._view:
            self.views.publish(view, layer, layer + 1)
        self.layer_block_rows.append(self._block_count)
        return (q, *carried)

    def count_layer(self) -> None:
        """A layer without attention hooks ran (in a piece between hook points): it
        computed the current block rows."""
        self.layer_block_rows.append(self._block_count)

    def after_attention(self, layer: int) -> None:
        """After the attention of the layer that ends a piece: what a key selection's
        attention selected goes to the hooks."""
        if self._selected is None or self._selected[0] != layer:
            return
        _, selected = self._selected
        self._selected = None
        self.hooks.after_key_scoring(layer, selected)

    def wants_output(self, layer: int) -> bool:
        return layer in self.declared.after_output

    def after_output(self, layer: int, output: torch.Tensor, *carried: torch.Tensor
                     ) -> tuple[torch.Tensor, ...]:
        """output: [T', hidden] the layer's output in the residual stream."""
        selection = self.hooks.after_output(LayerInput(layer, self.rows,
                                                       hidden=self._real(output)))
        if selection is None:
            return carried
        self._narrow(selection, layer, attending_from=layer + 1)
        return self._keep(selection, *(self._real(t) for t in carried))

    def _narrow(self, selection: RowSelection, layer: int, attending_from: int) -> None:
        """Keep the selected rows, queries and keys, and publish their view for the layers
        after ``layer`` (``attending_from``: the first layer whose queries they are)."""
        rows = self.step_rows
        rows.keep_queries(selection.keep, selection.kv_lens or {})
        rows.keep_keys(selection.keep)
        if attending_from < len(self.views.layer_names):
            self._view = self.views.view(
                rows, planned=attending_from <= self._last_dense_layer)
            self.views.publish(self._view, layer + 1)

    def _real(self, tensor: torch.Tensor) -> torch.Tensor:
        """The real rows of a row tensor (without bucket padding)."""
        return tensor[:len(self.rows)]

    def _padded(self, tensor: torch.Tensor) -> torch.Tensor:
        """A row tensor of the real rows, padded with zero rows up to its bucket."""
        rows = len(self.rows)
        bucket = next((b for b in self.row_buckets or () if b >= rows), rows)
        if bucket == rows:
            return tensor
        return torch.cat([tensor, tensor.new_zeros(bucket - rows, *tensor.shape[1:])])

    def _keep(self, selection: RowSelection, *tensors: torch.Tensor
              ) -> tuple[torch.Tensor, ...]:
        """The continuing rows of each tensor (rows along its last dimension for 1-D
        positions, its first otherwise); [T', hidden] pairs go through the compaction
        kernel."""
        keep_rows = torch.nonzero(selection.keep).flatten()
        self.rows = self.rows[keep_rows]
        self._block_count = int(self.block_rows[self.rows].sum())
        kept = []
        for tensor in tensors:
            device_rows = keep_rows.to(tensor.device)
            if tensor.dim() == 2 and tensor.dtype.is_floating_point:
                tensor, _ = kernel("compact_rows", tensor.device)(tensor, None, device_rows)
            else:
                tensor = tensor[..., device_rows]
            kept.append(self._padded(tensor))
        if self.row_buckets is not None and kept:
            self.padding_rows += len(kept[0]) - len(self.rows) if kept[0].dim() > 1 else 0
        return tuple(kept)
