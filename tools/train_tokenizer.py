"""Train the byte-level BPE tokenizer of the tiny SDAR chat model
(``vllm_diffusion_lab.training.tokenizer``).

Usage:
    python tools/train_tokenizer.py --out /tmp/sdar-tok [--vocab-size 1024]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_diffusion_lab.quality.corpus import train_examples
from vllm_diffusion_lab.training.tokenizer import DEFAULT_VOCAB_SIZE, build_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = parser.parse_args()
    tokenizer = build_tokenizer(train_examples(), args.vocab_size)
    tokenizer.save_pretrained(args.out)
    print(f"saved tokenizer with {len(tokenizer)} tokens to {args.out}")


if __name__ == "__main__":
    main()
