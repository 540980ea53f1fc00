"""Grow a checkpoint saved by tools/train_sdar.py into a deeper one that computes the same function.

    python tools/grow_depth.py vllm_diffusion/checkpoints/sdar-tiny-chat /work/ckpt/sdar-grown-0 \
        --new-layers-after-each 2 --max-position-embeddings 4096

Each source layer is followed by `--new-layers-after-each` new layers (block expansion, as in
LLaMA Pro). A new layer starts with random attention and MLP weights but zero output
projections (`o_proj`, `down_proj`), so it adds nothing to the residual stream: the grown
model's logits equal the source's until training moves those projections. Training then
continues from the grown checkpoint with `tools/train_sdar.py --init`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cast_checkpoint import write_checkpoint  # noqa: E402

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


def main() -> None:
    from sample_sdar import qwen3_config_from_sdar
    from transformers import Qwen3ForCausalLM

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--new-layers-after-each", type=int, required=True)
    parser.add_argument("--max-position-embeddings", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.new_layers_after_each < 1:
        raise SystemExit("--new-layers-after-each must be at least 1")
    config = json.loads((args.src / "config.json").read_text())
    source_layers = config["num_hidden_layers"]
    sources = grown_layer_sources(source_layers, args.new_layers_after_each)
    config.update(num_hidden_layers=len(sources), max_window_layers=len(sources),
                  torch_dtype="float32")
    if args.max_position_embeddings is not None:
        config["max_position_embeddings"] = args.max_position_embeddings
    torch.manual_seed(args.seed)
    fresh = Qwen3ForCausalLM(qwen3_config_from_sdar(config)).state_dict()
    source = {name: t.float() for name, t in load_file(args.src / "model.safetensors").items()}
    write_checkpoint(args.src, args.dst, config, grow_state_dict(source, fresh, sources))
    print(f"{args.src} ({source_layers} layers) -> {args.dst} ({len(sources)} layers; "
          f"sources {sources})")

if __name__ == "__main__":
    main()
