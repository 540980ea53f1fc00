"""Copy a checkpoint saved by tools/train_sdar.py with its weights cast to another dtype.

    python tools/cast_checkpoint.py SRC DST --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def write_checkpoint(src: Path, dst: Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    """``dst`` as a copy of the checkpoint ``src`` (tokenizer, templates) with ``config`` and
    ``weights`` in place of its own."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.name not in ("model.safetensors", "config.json") and path.is_file():
            shutil.copy2(path, dst / path.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({name: t.contiguous() for name, t in weights.items()}, dst / "model.safetensors",
              metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), required=True)
    args = parser.parse_args()
    config = json.loads((args.src / "config.json").read_text())
    config["torch_dtype"] = args.dtype
    dtype = getattr(torch, args.dtype)
    weights = {name: t.to(dtype) for name, t in load_file(args.src / "model.safetensors").items()}
    write_checkpoint(args.src, args.dst, config, weights)


if __name__ == "__main__":
    main()
