"""Convert SmolLM2-135M-Instruct to block diffusion (Fast-dLLM v2's form): train the
adapter (LoRA, norms, mask row; ``real_model/conversion.py``) on the original's own
answers (``tools/distill_smollm2.py``), in resumable stages.

    python tools/train_smollm2.py --out DIR --minutes 60 [--init DIR] [--device cuda]

Each stage continues from ``--init`` (an earlier stage's directory: adapter and optimizer
state) and saves ``adapter.safetensors``, ``optimizer.pt`` and ``state.json`` to ``--out``
every ``--save-minutes`` and at its end; the learning rate follows one cosine schedule of
``--total-steps`` across stages. A log line per step goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import time
from collections import Counter

import torch
from safetensors.torch import load_file, save_file

from vllm_diffusion_lab.real_model import original_checkpoint
from vllm_diffusion_lab.real_model.conversion import ConversionModel, LlamaShape
from vllm_diffusion_lab.real_model.data import distilled_path, excluded_prompts
from vllm_diffusion_lab.real_model.layout import batch_loss, make_batch, padded_sequence


def repeats_itself(ids: list[int], n: int = 4, most: int = 3) -> bool:
    """Whether some n-gram occurs more than ``most`` times (a looping answer)."""
    counts = Counter(tuple(ids[i:i + n]) for i in range(len(ids) - n + 1))
    return bool(counts) and max(counts.values()) > most


def load_examples(path: pathlib.Path, max_length: int) -> list[dict]:
    """The distilled answers, without evaluation prompts, looping answers or prompts that
    leave no room (an unfinished answer is kept, cut at ``max_length``)."""
    banned = {" ".join(p.lower().split()) for p in excluded_prompts()}
    examples = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a stopped distillation
            continue
        if " ".join(record["prompt"].lower().split()) in banned:
            continue
        if len(record["prompt_ids"]) >= max_length - 8 or repeats_itself(record["answer_ids"]):
            continue
        examples.append(record)
    return examples


def parse_block_sizes(text: str) -> tuple[list[int], list[float]]:
    sizes, weights = [], []
    for part in text.split(","):
        size, _, weight = part.partition(":")
        sizes.append(int(size))
        weights.append(float(weight or 1))
    return sizes, weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--init", type=pathlib.Path, default=None)
    parser.add_argument("--data", type=pathlib.Path, default=None)
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--save-minutes", type=float, default=10)
    parser.add_argument("--total-steps", type=int, default=600)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--block-sizes", default="4:1,8:2,16:2",
                        help="block sizes drawn per step, with weights")
    parser.add_argument("--full", action="store_true",
                        help="also train every linear weight (full fine-tuning: only to "
                             "compare with the adapter; its result is not stored)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base_dir = original_checkpoint()
    config = json.loads((base_dir / "config.json").read_text())
    base = {k: v.to(args.device) for k, v in load_file(base_dir / "model.safetensors").items()}
    model = ConversionModel(base, LlamaShape.from_config(config), rank=args.rank,
                            alpha=args.alpha, seed=args.seed,
                            full=args.full).to(args.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    state = {"step": 0, "rank": args.rank, "alpha": args.alpha, "full": args.full, "log": []}
    if args.init:
        model.load_adapter(load_file(args.init / "adapter.safetensors"))
        optimizer.load_state_dict(torch.load(args.init / "optimizer.pt"))
        state = json.loads((args.init / "state.json").read_text())
    examples = load_examples(args.data or distilled_path(), args.max_length)
    sizes, weights = parse_block_sizes(args.block_sizes)
    rng = random.Random(args.seed * 1000 + state["step"])
    generator = torch.Generator().manual_seed(args.seed * 1000 + state["step"])
    print(f"{len(examples)} examples; from step {state['step']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        save_file({k: v.contiguous().cpu() for k, v in model.adapter_state().items()},
                  args.out / "adapter.safetensors")
        torch.save(optimizer.state_dict(), args.out / "optimizer.pt")
        (args.out / "state.json").write_text(json.dumps(state))

    start = last_save = time.time()
    pending: list[list[dict]] = []
    while time.time() - start < args.minutes * 60 and (
            args.max_steps is None or state["step"] < args.max_steps):
        step = state["step"]
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.total_steps))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        block_size = rng.choices(sizes, weights)[0]
        if not pending:  # six batches of similar lengths from 48 random examples
            drawn = sorted(rng.sample(examples, 6 * args.batch),
                           key=lambda r: len(r["prompt_ids"]) + len(r["answer_ids"]))
            pending = [drawn[i:i + args.batch] for i in range(0, len(drawn), args.batch)]
            rng.shuffle(pending)
        chosen = [padded_sequence(r["prompt_ids"], r["answer_ids"], block_size,
                                  args.max_length) for r in pending.pop()]
        batch = make_batch([c for c in chosen if c is not None], block_size, generator)
        batch = type(batch)(**{k: v.to(args.device) for k, v in vars(batch).items()})
        t0 = time.time()
        loss, parts = batch_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] = step + 1
        entry = {"step": step + 1, "block": block_size, "loss": round(loss.item(), 4),
                 "block_first": round(parts["block_first"], 4),
                 "masked": round(parts["masked"], 4), "targets": int(parts["targets"]),
                 "lr": round(lr, 7), "seconds": round(time.time() - t0, 1)}
        state["log"].append(entry)
        print(json.dumps(entry), flush=True)
        if time.time() - last_save > args.save_minutes * 60:
            save()
            last_save = time.time()
    save()
    print(f"saved {args.out} at step {state['step']}", flush=True)


if __name__ == "__main__":
    main()
