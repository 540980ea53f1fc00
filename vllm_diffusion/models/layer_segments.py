"""A forward with hooks in compiled pieces: the layers between a policy's hook points.

A forward is a chain of half layers: unit 2l is layer l's ``attention_inputs`` (norm and
projections), unit 2l + 1 its ``attention_output`` (attention, norm and MLP). A step's
hooks run between units (``step_run``): ``before_attention`` and ``select_keys`` (or
a ``preselect_keys`` layer's selection, on a step that also has hooks between layers) of
layer l after unit 2l (a key selection has an ``after_attention`` after unit 2l + 1,
which hands what the attention selected to the hooks), ``after_output`` of layer l after
unit 2l + 1.
A step whose hooks only preselect keys does not come here: the model runs whole. The
units between two hook points form a piece, compiled once by ``torch.compile`` with a
dynamic row dimension, so the rows a hook keeps go through the later layers
compiled, whatever their number. The hooks themselves, which make data-dependent choices
on the host, run eagerly between the pieces.

vLLM's attention is an opaque custom op on the platforms that compile this way, so a piece
calls it as the whole-model graph does, and the op reads its layer's view of the step's
rows from the forward context, which the run publishes at the hook point before the
piece (no piece's traced code reads a view). Each piece gets its own copy of the code
object that runs it, so torch.compile caches its graphs per piece (the recompile limit
counts per code object).
Pieces compile on their first use; with ``--enforce-eager`` they run eagerly, and so do
the pieces of a hook set with a hook at every layer (no piece spans a whole layer:
compiling the 2L half layers of a key selection at every layer cost 8 s at its first step
and saved nothing, measured on the default model).
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
    ``final_norm`` as in ``_run_units``."""
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
    objects for the process's life: the piece's layers (modules, hook dicts, parameters)
    and the modules and constants its code reads (as vLLM's own compiled forward drops
    every guard). Checking those cost about 0.27 ms per piece call on the default model."""
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
