"""Depth growth by block expansion (as in LLaMA Pro): a deeper SDAR that computes the same
function as its source until training moves the new layers' output projections
(``tools/grow_depth.py``)."""

from __future__ import annotations

import re

import torch

LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
ZEROED_PROJECTIONS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def grown_layer_sources(num_source_layers: int, new_layers_after_each: int) -> list[int | None]:
    """For each layer of the grown model, the source layer it copies, or None for a new layer."""
    order: list[int | None] = []
    for layer in range(num_source_layers):
        order += [layer] + [None] * new_layers_after_each
    return order


def grow_state_dict(source: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor],
                    sources: list[int | None]) -> dict[str, torch.Tensor]:
    """The grown model's weights: `fresh` is a randomly initialised state dict of the grown
    architecture; layers with a source copy it, new layers keep their fresh weights with
    zeroed output projections, and everything outside the layers comes from `source`."""
    grown: dict[str, torch.Tensor] = {}
    for name, tensor in fresh.items():
        match = LAYER_KEY.fullmatch(name)
        if match is None:
            grown[name] = source[name].clone()
            continue
        layer, suffix = int(match.group(1)), match.group(2)
        if sources[layer] is not None:
            grown[name] = source[f"model.layers.{sources[layer]}.{suffix}"].clone()
        elif suffix in ZEROED_PROJECTIONS:
            grown[name] = torch.zeros_like(tensor)
        else:
            grown[name] = tensor.clone()
    return grown
