"""Writing an SDAR checkpoint directory from another one: its tokenizer and templates copied,
its config and weights replaced (the cast and depth-growth tools)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file


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
