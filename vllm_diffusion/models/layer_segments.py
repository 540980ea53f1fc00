"""A forward with hooks in compiled pieces: the layers between a policy's hook points.

Unit 2l is layer l's ``attention_inputs``, unit 2l + 1 its ``attention_output``; the units
between two hook points form a piece, compiled once with a dynamic row dimension (eager
with ``--enforce-eager`` or a hook at every layer), the hooks running eagerly between the
pieces. Where the cuts fall and why: docs/models.md, "The model contract".
"""

from __future__ import annotations

import types
import weakref

import torch
import torch.nn as nn

from vllm_diffusion.step.hooks import LayerHooks


def piece_boundaries(declared: LayerHooks, num_layers: int) -> list[tuple[int, int]]:
    """(first unit, last unit) of each piece, in order, for hooks at ``declared`` layers."""
    cuts = {2 * num_layers - 1}
    # a key selection goes into its layer's view before the attention, and what that
    # attention selected to the hooks after it
    for layer in (*declared.select_keys, *declared.preselect_keys):
        cuts |= {2 * layer, 2 * layer + 1}
    cuts |= {2 * layer for layer in declared.before_attention}
    for layer in declared.after_output:
        cuts.add(2 * layer + 1)
    pieces, first = [], 0
    for last in sorted(c for c in cuts if c < 2 * num_layers):
        pieces.append((first, last))
        first = last + 1
    return pieces


def _run_units(layers, first, last, positions, hidden, residual, q, k, v, embed, final_norm):
    """Units first..last of ``layers``; the state between them is (hidden, residual) after
    an odd unit and (q, k, v, residual) after an even one. With ``embed`` ``hidden`` holds
    the input ids (the first piece); with ``final_norm`` the hidden states returned are
    normed (the last piece, when no hook follows it)."""
    if embed is not None:
        hidden = embed(hidden)
    for unit in range(first, last + 1):
        layer = layers[unit // 2]
        if unit % 2 == 0:
            q, k, v, residual = layer.attention_inputs(positions, hidden, residual)
        else:
            hidden, residual = layer.attention_output(positions, q, k, v, residual)
    if final_norm is not None:
        hidden, residual = final_norm(hidden, residual)
    return hidden, residual, q, k, v


def _piece(layers: list[nn.Module], first: int, last: int, compiled: bool,
           embed: nn.Module | None = None, final_norm: nn.Module | None = None):
    """Units first..last as one callable (positions, hidden, residual, q, k, v) ->
    (hidden, residual, q, k, v), compiled with a dynamic row dimension; ``embed`` and
    ``final_norm`` as in ``_run_units``. Its own code objects: torch.compile caches graphs
    (and counts recompiles) per code object."""
    code = _run_units.__code__.replace(co_name=f"diffusion_units_{first}_{last}")
    run_units = types.FunctionType(code, _run_units.__globals__, code.co_name)

    def piece(positions, hidden, residual, q, k, v):
        return run_units(layers, first, last, positions, hidden, residual, q, k, v, embed,
                         final_norm)

    piece.__code__ = piece.__code__.replace(co_name=f"diffusion_piece_{first}_{last}")
    if not compiled:
        return piece
    return torch.compile(piece, dynamic=True,
                         options={"guard_filter_fn": _input_guards})


_PIECE_INPUTS = ("positions", "hidden", "residual", "q", "k", "v")


def _input_guards(entries) -> list[bool]:
    """Keep the guards on a piece's inputs (shapes, strides, dtypes, None or not), its
    shape environment and the global grad/device state; drop those on what stays the same
    objects for the process's life (its layers, the modules and constants its code reads),
    as vLLM's own compiled forward drops every guard."""
    return [not entry.name or entry.name.split("[")[0].split(".")[0] in _PIECE_INPUTS
            for entry in entries]


class LayerSegments:
    """The pieces of a model's forward for one set of hook layers: the input embedding
    runs in the first piece, the final norm in the last one unless a hook follows it."""

    def __init__(self, layers: list[nn.Module], declared: LayerHooks, compiled: bool,
                 embed: nn.Module, final_norm: nn.Module) -> None:
        self.layers = layers
        self.hooked_attention = {*declared.before_attention, *declared.select_keys,
                                 *declared.preselect_keys}
        boundaries = piece_boundaries(declared, len(layers))
        self.compiled = compiled and any(last > first for first, last in boundaries)
        self.final_norm = final_norm
        self.norm_in_last_piece = len(layers) - 1 not in declared.after_output
        self.pieces = [
            (first, last, _piece(layers, first, last, self.compiled,
                                 embed if first == 0 else None,
                                 final_norm if last == 2 * len(layers) - 1
                                 and self.norm_in_last_piece else None))
            for first, last in boundaries]

    def run(self, run, positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's forward with the run's hooks between the pieces; returns the final
        hidden states of the rows that continue (``run.rows`` names them)."""
        hidden, residual = input_ids, None
        q = k = v = None
        for first, last, piece in self.pieces:
            for unit in range(first + first % 2, last + 1, 2):  # the attention inputs
                if unit // 2 not in self.hooked_attention:
                    run.count_layer()  # its block rows: the current ones
            hidden, residual, q, k, v = piece(positions, hidden, residual, q, k, v)
            layer = self.layers[last // 2]
            index = layer.layer_index
            if last % 2 == 0:
                q, residual, positions = run.before_attention(
                    index, layer.attention_module, q, k, residual, positions)
                continue
            q = k = v = None
            run.after_attention(index)
            if run.wants_output(index):
                hidden, residual, positions = run.after_output(
                    index, hidden + residual, hidden, residual, positions)
        if not self.norm_in_last_piece:
            hidden, _ = self.final_norm(hidden, residual)
        return hidden


_SEGMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def segments_for(model: nn.Module, layers: list[nn.Module], declared: LayerHooks,
                 compiled: bool) -> LayerSegments:
    """The model's pieces for these hook layers (made once per model and hook set)."""
    by_hooks = _SEGMENTS.setdefault(model, {})
    key = (declared, compiled)
    if key not in by_hooks:
        by_hooks[key] = LayerSegments(layers, declared, compiled, model.embed_input_ids,
                                      model.norm)
    return by_hooks[key]
