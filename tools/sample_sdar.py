"""Greedy block-diffusion sampling from an SDAR checkpoint, for eyeballing and quick scoring
(``vllm_diffusion_lab.training.reference_decoding``: a plain decoding loop, no vLLM).

Usage:
    python tools/sample_sdar.py --model DIR --prompt "Count from 3 to 9."
    python tools/sample_sdar.py --model DIR --eval-per-family 20 --block-size 8
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from vllm_diffusion_lab.quality.corpus import eval_examples
from vllm_diffusion_lab.training.reference_decoding import evaluate, load_sdar, respond


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompt", action="append", default=[])
    parser.add_argument("--eval-per-family", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=None, help="default: config block_size")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, sdar, stop_ids = load_sdar(args.model)
    options = dict(mask_id=sdar["mask_token_id"], stop_ids=stop_ids,
                   block_size=args.block_size or sdar["block_size"], threshold=args.threshold)
    for prompt in args.prompt:
        print(f"> {prompt}\n{respond(model, tokenizer, prompt, **options)}")
    if args.eval_per_family:
        accuracy = evaluate(model, tokenizer, eval_examples(args.eval_per_family), show=3, **options)
        for family, value in accuracy.items():
            print(f"{family:>10}: {value:.2f}")
        print(f"{'mean':>10}: {sum(accuracy.values()) / len(accuracy):.2f}")


if __name__ == "__main__":
    main()
