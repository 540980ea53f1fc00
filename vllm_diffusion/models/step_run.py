"""The model contract: how a diffusion step's hooks run between a family's layer halves.

Each family's decoder layer owns its body in two halves around its attention
(``attention_inputs`` -> q, k, v and ``attention_output`` -> hidden; pre-norm families
inherit both from ``causal_lm.PreNormHalves``) and names its ``attention_module``. A step
without hooks runs the layers plainly (vLLM may compile the forward); a step with hooks
runs the halves as pieces (``layer_segments``), which call the run's hook points, in this
order:

- ``run.before_attention(layer, attention, q, k, *carried)``: after the layer's queries,
  keys and values (after q/k-norm and RoPE) and before its attention. The hooks of that
  layer may select keys for the attention (``select_keys``) and drop query rows
  (``before_attention``); returns the queries and the ``carried`` row tensors (the
  residual stream, positions, ...) of the rows that continue. The attention still stores
  every row's keys/values, then leaves the dropped rows' keys for the later layers
  (``StepRows.finish_attention``);
- ``run.after_attention(layer)``: after the attention of a layer with a key selection,
  which it ends;
- ``run.after_output(layer, output, *carried)`` when ``run.wants_output(layer)``: with the
  layer's output in the residual stream (``output``, which the hook reads); returns the
  ``carried`` tensors of the rows that continue.

``attention`` is the layer's attention module: its ``num_heads``, ``num_kv_heads``,
``head_dim`` and ``scaling`` (``attention_heads.init_block_diffusion_heads``) shape what
the hooks see. The run narrows the step's current rows (``step.rows.StepRows``), which the
attention reads; after the last layer ``run.rows`` holds the step rows of the output
hidden states (the first ``len(run.rows)`` rows of them: with ``row_buckets`` the rows
that continue after a drop are padded with zero rows up to a bucket, which the attention
never reads or stores, ``StepRows`` holding the real rows only, and which the hooks never
see) and ``run.layer_block_rows`` the block rows each layer computed.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm_diffusion.kernels.dispatch import kernel
from vllm_diffusion.step.hooks import LayerInput, RowSelection, StepHooks
from vllm_diffusion.step.rows import StepRows


class StepRun:
    """One forward of a diffusion step with hooks: the hooks in, its surviving rows out."""

    def __init__(self, hooks: StepHooks, block_rows: torch.Tensor, step_rows: StepRows,
                 compiled: bool = False, row_buckets: tuple[int, ...] | None = None) -> None:
        self.hooks = hooks
        # Row counts the continuing rows are padded to after a drop (None: no padding);
        # the padding rows follow the real ones, which ``rows`` lists
        self.row_buckets = row_buckets
        self.padding_rows = 0  # padding rows added, summed over the drops
        # Whether the layers between hook points run as compiled pieces (``layer_segments``)
        self.compiled = compiled
        self.declared = hooks.layers
        self.block_rows = block_rows  # [T] bool (host): the step's block rows
        self.step_rows = step_rows  # what the attention reads
        self.rows = torch.arange(len(block_rows))  # [T'] step rows of the current states
        self.layer_block_rows: list[int] = []  # per layer
        self._block_count = int(block_rows.sum())

    def before_attention(self, layer: int, attention: nn.Module, q: torch.Tensor,
                         k: torch.Tensor, *carried: torch.Tensor
                         ) -> tuple[torch.Tensor, ...]:
        """q [T', H * D], k [T', H_kv * D]; returns (q, *carried) of the continuing rows."""
        declared, selection = self.declared, None
        real = len(self.rows)  # rows beyond it are bucket padding
        if layer in declared.before_attention or layer in declared.select_keys:
            layer_input = LayerInput(
                layer, self.rows,
                query=q[:real].view(-1, attention.num_heads, attention.head_dim),
                key=k[:real].view(-1, attention.num_kv_heads, attention.head_dim),
                scale=attention.scaling)
            if layer in declared.select_keys:
                self.step_rows.key_selection = self.hooks.select_keys(layer_input)
            if layer in declared.before_attention:
                selection = self.hooks.before_attention(layer_input)
        if selection is not None:
            self.step_rows.keep_queries(selection.keep, selection.kv_lens or {})
            self.step_rows.keys_after_attention = selection.keep
            q, *carried = self._keep(selection, q[:real], *(self._real(t) for t in carried))
        self.layer_block_rows.append(self._block_count)
        return (q, *carried)

    def count_layer(self) -> None:
        """A layer without attention hooks ran (in a piece between hook points): it
        computed the current block rows."""
        self.layer_block_rows.append(self._block_count)

    def after_attention(self, layer: int) -> None:
        self.step_rows.key_selection = None

    def wants_output(self, layer: int) -> bool:
        return layer in self.declared.after_output

    def after_output(self, layer: int, output: torch.Tensor, *carried: torch.Tensor
                     ) -> tuple[torch.Tensor, ...]:
        """output: [T', hidden] the layer's output in the residual stream."""
        selection = self.hooks.after_output(LayerInput(layer, self.rows,
                                                       hidden=self._real(output)))
        if selection is None:
            return carried
        self.step_rows.keep_queries(selection.keep, selection.kv_lens or {})
        self.step_rows.keep_keys(selection.keep)
        return self._keep(selection, *(self._real(t) for t in carried))

    def _real(self, tensor: torch.Tensor) -> torch.Tensor:
        """The real rows of a row tensor (without bucket padding)."""
        rows = len(self.rows)
        return tensor[..., :rows] if tensor.dim() == 1 else tensor[:rows]

    def _padded(self, tensor: torch.Tensor) -> torch.Tensor:
        """A row tensor of the real rows, padded with zero rows up to its bucket."""
        rows = len(self.rows)
        bucket = next((b for b in self.row_buckets or () if b >= rows), rows)
        if bucket == rows:
            return tensor
        if tensor.dim() == 1:
            return torch.cat([tensor, tensor.new_zeros(bucket - rows)])
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
