"""Train a small full-attention masked-diffusion chat model in LLaDA's published format
(``LLaDAModelLM``, ``vllm_diffusion_lab.training.llada_format``) on the project corpus.

Usage (training/README.md gives the commands behind each stage):
    python tools/train_llada.py --from-sdar checkpoints/sdar-small-chat --out DIR --minutes 150
    python tools/train_llada.py --init DIR --out DIR2 --minutes 120 --lr 1e-4

Stage 1 starts from the SDAR default model (--from-sdar): its weights are renamed into
LLaDA's (embeddings, q/k/v/o, SwiGLU gate/up/down, the norms, the LM head), its q/k
RMSNorms are dropped (LLaDA has none), and only the layers of --keep-layers are kept (the
16 MB limit: 9 of 12 layers in bfloat16). SDAR was trained block-causal; this model
attends fully, so training must adapt it. Later stages continue from a checkpoint this
script saved (--init; the model shape comes from its config.json). The optimizer state is
not saved: each stage starts a fresh AdamW with its own warm-up and cosine schedule.

Objective: LLaDA's SFT loss as its repository's GUIDELINES.md gives it. Each row is the
chat-formatted prompt, the response ending in ``<|im_end|>``, then ``<|endoftext|>`` (LLaDA's
EOS) up to a response region of --canvas tokens (the inference canvas: 128, the quality
harness's max_tokens), and more EOS so that the rows of a batch have equal length (LLaDA
pads each mini-batch with EOS); the EOS padding is part of the response. Per row a ratio
p = eps + (1 - eps) t, t ~ U(0, 1) (eps = --mask-eps, 1e-3 as LLaDA) is drawn and each
response position is masked with probability p; the prompt is never masked. The loss is
sum over masked positions of CE / p / (the row's response length, EOS padding included),
divided by the batch size: the 1/t weight and the per-answer-length normalisation of LLaDA's
SFT. The log shows it (``loss``), the plain mean CE over masked positions (``ce``) and the
mean CE over masked positions before the EOS padding (``text``: the answer and <|im_end|>).

Each stage stops at its time budget (--minutes) or --max-steps; the cosine schedule length
is estimated from the speed of its first steps and printed, to pass back as --max-steps.
The checkpoint is saved every --checkpoint-minutes and at the end (in --save-dtype; cast
to bfloat16 with tools/cast_checkpoint.py for checkpoints/). At the end the model is scored
greedily on --eval-per-family held-out problems per family with LLaDA's generate.py loop
(canvas --eval-gen-length 128, blocks of --eval-block-length 32, one token per step).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from train_sdar import batches, optimize, parse_family_weight, tokenize_corpus
from transformers import PreTrainedTokenizerFast

from vllm_diffusion_lab.quality.corpus import eval_examples
from vllm_diffusion_lab.training import llada_format
from vllm_diffusion_lab.training.tokenizer import ENDOFTEXT, IM_END

# Of the default model's 12 layers: the tiny model's 0, 3, 6, 9 and five of the eight layers
# growth inserted; 4, 7 and 8 are dropped (training/README.md, llada-small-chat).
KEEP_LAYERS = (0, 1, 2, 3, 5, 6, 9, 10, 11)


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    minutes: float
    seed: int = 0
    threads: int = 1
    max_steps: int | None = None
    batch_size: int = 32
    lr: float = 2e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mask_eps: float = 1e-3
    canvas: int = 128
    log_every: int = 10
    estimate_after: int = 20
    checkpoint_minutes: float = 10.0
    device: str = "cpu"
    save_dtype: str = "float32"
    eval_per_family: int = 10
    eval_gen_length: int = 128
    eval_block_length: int = 32
    family_weights: tuple[tuple[str, float], ...] = field(default_factory=tuple)


def load_start(init: Path | None, from_sdar: Path | None, keep_layers: list[int]):
    """(model, config, tokenizer directory): a checkpoint of this script, or the SDAR one converted."""
    if init is not None:
        config = json.loads((init / "config.json").read_text())
        weights = load_file(init / "model.safetensors")
        source = init
    else:
        sdar = json.loads((from_sdar / "config.json").read_text())
        config = llada_format.config_from_sdar(sdar, len(keep_layers))
        weights = llada_format.sdar_to_llada(load_file(from_sdar / "model.safetensors"), keep_layers)
        source = from_sdar
    model = llada_format.LLaDAModelLM(config)
    model.load_state_dict({name: t.float() for name, t in weights.items()})
    return model, config, source


def train(config: TrainConfig, init: Path | None, from_sdar: Path | None, keep_layers: list[int]) -> None:
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    rng, generator = random.Random(config.seed), torch.Generator().manual_seed(config.seed)
    model, llada, source = load_start(init, from_sdar, keep_layers)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    if llada["eos_token_id"] != endoftext:
        raise ValueError(f"config eos {llada['eos_token_id']} is not {ENDOFTEXT} ({endoftext})")
    llada = {**llada, "torch_dtype": config.save_dtype}
    mask_id = llada["mask_token_id"]
    model.to(config.device).train()
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{'continuing from ' + str(init) if init else f'converted from {from_sdar}, layers {keep_layers}'}; "
          f"{num_params / 1e6:.2f}M parameters ({2 * num_params / 1e6:.2f} MB in bfloat16), "
          f"{llada['n_layers']} layers, d_model {llada['d_model']}", flush=True)
    data = tokenize_corpus(tokenizer, dict(config.family_weights) or None)
    print(f"{len(data)} training examples, response canvas {config.canvas}", flush=True)
    order = batches([len(p) + max(len(r), config.canvas) for p, r in data], config.batch_size, rng)

    def save() -> None:
        llada_format.save_checkpoint(model.state_dict(), llada, source, config.out, im_end)

    def loss_of(rows: list) -> tuple[torch.Tensor, int, dict[str, float]]:
        ids, prompt_lengths = llada_format.sft_batch(rows, config.canvas, endoftext)
        loss, info = llada_format.sft_loss(model, ids, prompt_lengths, mask_id=mask_id,
                                           eps=config.mask_eps, generator=generator)
        text = (ids != endoftext)[info["masked"]].to(info["ce"].device)
        return loss, ids.numel(), {
            "ce": info["ce"].mean().item() if len(info["ce"]) else 0.0,
            "text": info["ce"][text].mean().item() if text.any() else 0.0}

    optimize(model, loss_of, lambda: [data[i] for i in next(order)], config, config.minutes,
             config.max_steps, save, "--max-steps")
    model.eval()
    save()
    print(f"saved checkpoint to {config.out} "
          f"({(config.out / 'model.safetensors').stat().st_size} bytes in {config.save_dtype})", flush=True)
    if config.eval_per_family:
        accuracy = llada_format.evaluate(
            model, tokenizer, eval_examples(config.eval_per_family), mask_id=mask_id,
            stop_ids=[im_end, endoftext], gen_length=config.eval_gen_length,
            block_length=config.eval_block_length, show=3)
        print(f"held-out accuracy, greedy, LLaDA loop (canvas {config.eval_gen_length}, block "
              f"{config.eval_block_length}, one token per step): "
              + ", ".join(f"{family} {value:.2f}" for family, value in accuracy.items())
              + f"; mean {sum(accuracy.values()) / len(accuracy):.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    start = parser.add_mutually_exclusive_group(required=True)
    start.add_argument("--from-sdar", type=Path, help="convert this SDAR checkpoint (stage 1)")
    start.add_argument("--init", type=Path, help="continue from a checkpoint this script saved")
    parser.add_argument("--keep-layers", type=int, nargs="+", default=list(KEEP_LAYERS),
                        help="with --from-sdar: the SDAR layers kept, in order")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps)
    parser.add_argument("--mask-eps", type=float, default=TrainConfig.mask_eps)
    parser.add_argument("--canvas", type=int, default=TrainConfig.canvas,
                        help="response region length the EOS padding fills (the inference canvas)")
    parser.add_argument("--log-every", type=int, default=TrainConfig.log_every)
    parser.add_argument("--checkpoint-minutes", type=float, default=TrainConfig.checkpoint_minutes)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--eval-per-family", type=int, default=TrainConfig.eval_per_family)
    parser.add_argument("--eval-gen-length", type=int, default=TrainConfig.eval_gen_length)
    parser.add_argument("--eval-block-length", type=int, default=TrainConfig.eval_block_length)
    parser.add_argument("--family-weight", action="append", default=[], metavar="FAMILY=W",
                        help="override a family's sampling weight (repeatable), e.g. range=3")
    args = parser.parse_args()
    if not math.isfinite(args.minutes) or args.minutes < 0:
        raise SystemExit("--minutes must be a non-negative number")
    config = TrainConfig(
        out=args.out, minutes=args.minutes, seed=args.seed, threads=args.threads,
        max_steps=args.max_steps, batch_size=args.batch_size, lr=args.lr,
        warmup_steps=args.warmup_steps, mask_eps=args.mask_eps, canvas=args.canvas,
        log_every=args.log_every, checkpoint_minutes=args.checkpoint_minutes, device=args.device,
        save_dtype=args.save_dtype, eval_per_family=args.eval_per_family,
        eval_gen_length=args.eval_gen_length, eval_block_length=args.eval_block_length,
        family_weights=tuple(parse_family_weight(w) for w in args.family_weight))
    train(config, args.init, args.from_sdar, args.keep_layers)


if __name__ == "__main__":
    main()
