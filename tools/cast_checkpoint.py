"""Copy a checkpoint saved by tools/train_sdar.py with its weights cast to another dtype.

    python tools/cast_checkpoint.py SRC DST --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm_diffusion_lab.training.checkpoint_files import write_checkpoint


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
