"""Held-out loss of SmolLM2 conversion adapters: the training objective (``layout.py``) on
fixed batches of the evaluation set's prompts with the original's greedy answers (from a
``benchmarks/real_model_quality.py`` report, never trained on), the same masks for every
adapter. Compares a training stage's float32 adapter with the repository's stored one
(int8 factors) or with a full fine-tuning stage.

    python tools/conversion_loss.py results/real_model_quality.json \
        /work/ckpt/stage2 checkpoints/smollm2-dllm --block-size 8 --examples 64
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
from safetensors.torch import load_file

from vllm_diffusion_lab.real_model import original_checkpoint
from vllm_diffusion_lab.real_model.conversion import ConversionModel, LlamaShape
from vllm_diffusion_lab.real_model.converted import loaded_adapter
from vllm_diffusion_lab.real_model.layout import batch_loss, make_batch, padded_sequence


def load_model(directory: pathlib.Path, base: dict, shape: LlamaShape) -> ConversionModel:
    """A training stage (state.json: float32 adapter, or full weights with ``full``) or a
    stored adapter directory (conversion.json: int8 factors)."""
    if (directory / "conversion.json").exists():
        meta = json.loads((directory / "conversion.json").read_text())
        adapter = loaded_adapter(load_file(directory / "adapter.safetensors"))
    else:
        meta = json.loads((directory / "state.json").read_text())
        adapter = load_file(directory / "adapter.safetensors")
    model = ConversionModel(base, shape, rank=meta["rank"], alpha=meta["alpha"],
                            full=meta.get("full", False))
    model.load_adapter(adapter)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=pathlib.Path)
    parser.add_argument("adapters", type=pathlib.Path, nargs="+")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = json.loads(args.report.read_text())
    from transformers import AutoTokenizer

    from vllm_diffusion_lab.real_model.evaluation import chat_prompt_ids
    tokenizer = AutoTokenizer.from_pretrained(original_checkpoint())
    prompt_ids = chat_prompt_ids(tokenizer, report["prompts"])
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sequences = []
    for prompt, answer in zip(prompt_ids, report["answers"]["original_greedy"]):
        seq = padded_sequence(prompt, answer + [stop], args.block_size, 256)
        if seq is not None:
            sequences.append(seq)
    step = max(1, len(sequences) // args.examples)
    sequences = sequences[::step][:args.examples]
    base_dir = original_checkpoint()
    base = load_file(base_dir / "model.safetensors")
    shape = LlamaShape.from_config(json.loads((base_dir / "config.json").read_text()))
    results = {}
    for directory in args.adapters:
        model = load_model(directory, base, shape)
        generator = torch.Generator().manual_seed(0)
        totals = {"loss": 0.0, "block_first": 0.0, "masked": 0.0}
        batches = 0
        with torch.no_grad():
            for i in range(0, len(sequences), args.batch):
                loss, parts = batch_loss(model, make_batch(sequences[i:i + args.batch],
                                                           args.block_size, generator))
                totals["loss"] += loss.item()
                totals["block_first"] += parts["block_first"]
                totals["masked"] += parts["masked"]
                batches += 1
        results[str(directory)] = {k: round(v / batches, 4) for k, v in totals.items()}
        print(directory, results[str(directory)], flush=True)
    print(json.dumps({"block_size": args.block_size, "examples": len(sequences),
                      "results": results}))


if __name__ == "__main__":
    main()
