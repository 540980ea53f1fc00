"""Grow a checkpoint saved by tools/train_sdar.py into a deeper one that computes the same function.

    python tools/grow_depth.py checkpoints/sdar-tiny-chat /work/ckpt/sdar-grown-0 \
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
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm_diffusion_lab.training.checkpoint_files import write_checkpoint
from vllm_diffusion_lab.training.depth_growth import grow_state_dict, grown_layer_sources


def main() -> None:
    from transformers import Qwen3ForCausalLM

    from vllm_diffusion_lab.training.reference_decoding import qwen3_config_from_sdar

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
