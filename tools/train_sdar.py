"""Train a tiny SDAR (Qwen3-architecture) block-diffusion chat model on the project corpus.

Usage (docs/models.md, "The embedded models", gives the commands that made the committed checkpoint):
    python tools/train_sdar.py --out DIR --ar-minutes 15 --minutes 40 --threads 1
    python tools/train_sdar.py --init DIR --out DIR2 --minutes 45 --threads 2 --lr 1e-3

The same script trains on a GPU (--device cuda, the default where one is present); the
model trains in float32 and --save-dtype sets the dtype of the saved weights. With --init
the model size comes from that checkpoint's config.json.

An optional autoregressive warm start (--ar-minutes: next-token loss on the responses
under the causal mask, as SDAR starts from an autoregressive model) comes first. Each
stage stops at its time budget; its cosine schedule length is estimated from the speed of
its first steps and printed: pass it back (--ar-max-steps, --max-steps) for a rerun with
the same steps. At the end the checkpoint is scored greedily on a few held-out prompts
per family (``vllm_diffusion_lab.training.reference_decoding``, as tools/sample_sdar.py).

Objective (BD3-LM, vectorised): the model reads [noisy ; clean] with
position ids 0..L-1 for both halves. Per block, a fraction t ~ U(eps, 1) of
the response positions is replaced by the mask token (prompt tokens never
are). Noisy block b attends to itself bidirectionally and to clean blocks
< b; clean block b attends to clean blocks <= b. The loss is the plain mean
cross-entropy over masked positions: the 1/t ELBO weight would multiply the
gradient of nearly-clean blocks by up to 1/eps, which is too noisy for a few
thousand small-batch steps, and greedy confidence decoding needs a good
argmax, not a calibrated likelihood. The block size is drawn per batch from
{1, 2, 4, 8, 16, 32, 64} (--block-sizes), so one checkpoint serves every block size; the
noisy copies of prompt-only blocks are left out of the pass (nothing attends to them).

Targets: response tokens, then ``<|im_end|>``, then ``<|endoftext|>`` up to the
end of the block holding ``<|im_end|>`` (what the model writes there at
inference); later all-padding blocks are never loss targets.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen3ForCausalLM

from vllm_diffusion_lab.quality.corpus import eval_examples, is_eval_problem, train_examples
from vllm_diffusion_lab.quality.retrieval import retrieval_examples, retrieval_problem
from vllm_diffusion_lab.training.reference_decoding import (block_causal_mask, evaluate,
                                                            qwen3_config_from_sdar)
from vllm_diffusion_lab.training.tokenizer import ENDOFTEXT, IM_END, IM_START, MASK, build_tokenizer

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "checkpoints/sdar-tiny-chat"
# 1 and 2 add dense, nearly autoregressive targets (every response token masked).
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)
SERVING_BLOCK_SIZE = 4


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    minutes: float
    seed: int
    threads: int
    max_steps: int | None = None  # default: estimated from the time budget after `estimate_after` steps
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mask_eps: float = 0.05
    log_every: int = 25
    estimate_after: int = 50
    eval_per_family: int = 10
    checkpoint_minutes: float = 10.0
    init: Path | None = None  # continue from the weights of a checkpoint saved by this script
    device: str = "cpu"  # "cuda" trains on the GPU with the same code
    save_dtype: str = "float32"  # the committed weights' dtype (the model trains in float32)
    ar_minutes: float = 0.0  # autoregressive warm start before block-diffusion training
    block_sizes: tuple[int, ...] = BLOCK_SIZES  # drawn uniformly per batch
    ar_max_steps: int | None = None
    # Long-prompt retrieval (vllm_diffusion_lab/quality/retrieval.py): the share of steps
    # that train on it, the passage length range in words, and the token budget of one such
    # batch.
    retrieval_fraction: float = 0.0
    retrieval_words: tuple[int, int] = (50, 3000)
    retrieval_batch_tokens: int = 8192
    # Family sampling weights overriding the corpus's (a later stage's emphasis on weak ones).
    family_weights: tuple[tuple[str, float], ...] = ()


# ------------------------------------------------------------------- data
def chat_prompt(prompt: str) -> str:
    return f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n"


def retrieval_batches(tokenizer: PreTrainedTokenizerBase, config: TrainConfig, rng: random.Random):
    """Endless batches of training-split retrieval problems, each batch filling
    ``retrieval_batch_tokens`` (at least one problem)."""
    while True:
        items, tokens = [], 0
        while not items or tokens < config.retrieval_batch_tokens:
            prompt, answer = retrieval_problem(rng, rng.randint(*config.retrieval_words))
            if is_eval_problem("retrieval", answer):
                continue
            prompt_ids = tokenizer(chat_prompt(prompt), add_special_tokens=False)["input_ids"]
            response_ids = tokenizer(answer + IM_END, add_special_tokens=False)["input_ids"]
            items.append((prompt_ids, response_ids))
            tokens += len(prompt_ids) + len(response_ids)
        yield items


def tokenize_corpus(tokenizer: PreTrainedTokenizerBase, family_weights: dict[str, float] | None = None
                    ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids ending in <|im_end|>) for every training example."""
    examples = train_examples(family_weights=family_weights)
    # Rendering the Jinja template 60k times is slow; format directly and check one against it.
    prompts = [chat_prompt(e.prompt) for e in examples]
    reference = tokenizer.apply_chat_template([{"role": "user", "content": examples[0].prompt}],
                                              add_generation_prompt=True, tokenize=False)
    if prompts[0] != reference:
        raise ValueError(f"chat template changed: {reference!r} != {prompts[0]!r}")
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer([e.answer + IM_END for e in examples], add_special_tokens=False)["input_ids"]
    return list(zip(prompt_ids, response_ids))


def batches(lengths: list[int], batch_size: int, rng: random.Random):
    """Endless index batches of similar length (less padding), in shuffled order."""
    while True:
        order = list(range(len(lengths)))
        rng.shuffle(order)
        pool_size = batch_size * 64
        for pool_start in range(0, len(order) - batch_size + 1, pool_size):
            pool = sorted(order[pool_start:pool_start + pool_size], key=lengths.__getitem__)
            chunks = [pool[i:i + batch_size] for i in range(0, len(pool) - batch_size + 1, batch_size)]
            rng.shuffle(chunks)
            yield from chunks


def collate(items: list[tuple[list[int], list[int]]], block_size: int, pad_id: int):
    """Returns clean ids [b, L] and loss-eligible positions [b, L], L a multiple of block_size."""
    padded = [-(-(len(p) + len(r)) // block_size) * block_size for p, r in items]
    length = max(padded)
    clean = torch.full((len(items), length), pad_id, dtype=torch.long)
    eligible = torch.zeros((len(items), length), dtype=torch.bool)
    for row, ((prompt, response), end) in enumerate(zip(items, padded)):
        clean[row, :len(prompt)] = torch.tensor(prompt)
        clean[row, len(prompt):len(prompt) + len(response)] = torch.tensor(response)
        eligible[row, len(prompt):end] = True
    return clean, eligible


def mask_blocks(clean: torch.Tensor, eligible: torch.Tensor, block_size: int, mask_id: int,
                eps: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask ceil(t * n) of the n eligible positions of every block, t ~ U(eps, 1) per block."""
    batch, length = clean.shape
    eligible_blocks = eligible.view(batch, length // block_size, block_size)  # [b, nb, BS]
    t = eps + (1 - eps) * torch.rand(eligible_blocks.shape[:2], generator=generator)  # [b, nb]
    count = (t * eligible_blocks.sum(-1)).ceil()  # [b, nb]
    scores = torch.rand(eligible_blocks.shape, generator=generator).masked_fill(~eligible_blocks, 2.0)
    ranks = scores.argsort(-1).argsort(-1)  # [b, nb, BS], eligible positions ranked first
    masked = (eligible_blocks & (ranks < count[..., None])).view(batch, length)
    return clean.masked_fill(masked, mask_id), masked


def training_attention_mask(length: int, block_size: int) -> torch.Tensor:
    """[2L - BS, 2L - BS] bool mask over [noisy (L) ; clean without its last block (L - BS)].

    The last clean block is dropped: no noisy block may attend to it.
    """
    blocks = torch.arange(length) // block_size
    clean_blocks = blocks[: length - block_size]
    noisy_rows = torch.cat([blocks[:, None] == blocks[None, :],
                            clean_blocks[None, :] < blocks[:, None]], dim=1)
    clean_rows = torch.cat([torch.zeros(len(clean_blocks), length, dtype=torch.bool),
                            clean_blocks[None, :] <= clean_blocks[:, None]], dim=1)
    return torch.cat([noisy_rows, clean_rows], dim=0)


def noisy_hidden_states(model: Qwen3ForCausalLM, noisy: torch.Tensor, clean: torch.Tensor,
                        block_size: int, start: int = 0) -> torch.Tensor:
    """Final hidden states [b, L - start, hidden] of the noisy half under the block-diffusion
    mask, from ``start`` (a block boundary: noisy blocks before it hold no mask in any row
    and are left out; nothing attends to them)."""
    batch, length = noisy.shape
    inputs = torch.cat([noisy[:, start:], clean[:, : length - block_size]], dim=1)
    positions = torch.cat([torch.arange(start, length), torch.arange(length - block_size)])
    kept = torch.cat([torch.arange(length) >= start, torch.ones(length - block_size, dtype=torch.bool)])
    attention_mask = training_attention_mask(length, block_size)[kept][:, kept][None, None]
    output = model.model(input_ids=inputs, attention_mask=attention_mask.to(inputs.device),
                         position_ids=positions[None].expand(batch, -1).to(inputs.device))
    return output.last_hidden_state[:, :length - start]


def check_attention_mask(seed: int = 0) -> None:
    """The joint [noisy ; clean] pass must equal separate block-causal passes per block.

    Guards against a transformers version that ignores or rewrites a custom 4-D mask.
    """
    torch.manual_seed(seed)
    sdar = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)
    model = Qwen3ForCausalLM(qwen3_config_from_sdar(sdar)).double().eval()
    block_size, length = 4, 14
    clean = torch.randint(0, 39, (1, length))
    noisy = clean.masked_fill(torch.rand(1, length) < 0.5, 39)
    padded = -(-length // block_size) * block_size
    clean, noisy = F.pad(clean, (0, padded - length), value=0), F.pad(noisy, (0, padded - length), value=0)
    with torch.no_grad():
        joint = noisy_hidden_states(model, noisy, clean, block_size)[0]  # [L, hidden]
        for start in range(0, padded, block_size):
            sequence = torch.cat([clean[0, :start], noisy[0, start:start + block_size]])[None]
            mask = block_causal_mask(sequence.shape[1], block_size)[None, None]
            alone = model.model(input_ids=sequence, attention_mask=mask).last_hidden_state[0, -block_size:]
            if not torch.allclose(joint[start:start + block_size], alone, atol=1e-9):
                raise AssertionError(f"block-diffusion mask is not honoured (block at {start})")
        skipped = noisy_hidden_states(model, noisy, clean, block_size, block_size)[0]
        if not torch.allclose(skipped, joint[block_size:], atol=1e-9):
            raise AssertionError("leaving out the first noisy block changes the others")


# --------------------------------------------------------------- training
def learning_rate(step: int, total_steps: int, config: TrainConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def sdar_config(size: ModelSize, tokenizer: PreTrainedTokenizerBase) -> dict:
    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    return {
        "architectures": ["SDARForCausalLM"], "model_type": "sdar",
        "vocab_size": len(tokenizer), **asdict(size),
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "rope_scaling": None, "tie_word_embeddings": False,
        "use_cache": True, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": size.num_hidden_layers,
        "bos_token_id": endoftext, "eos_token_id": im_end, "pad_token_id": endoftext,
        "block_size": SERVING_BLOCK_SIZE, "mask_token_id": tokenizer.convert_tokens_to_ids(MASK),
        "torch_dtype": "float32",
    }


def save_checkpoint(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, sdar: dict,
                    out: Path) -> None:
    """Write config, tokenizer, then the weights (atomically, last: readers key on model.safetensors)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(sdar, indent=2) + "\n")
    generation = {"bos_token_id": sdar["bos_token_id"], "pad_token_id": sdar["pad_token_id"],
                  "eos_token_id": [sdar["eos_token_id"], sdar["pad_token_id"]], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    dtype = getattr(torch, sdar["torch_dtype"])
    state = {name: tensor.detach().to("cpu", dtype).contiguous()
             for name, tensor in model.state_dict().items()}
    save_file(state, out / "model.safetensors.partial", metadata={"format": "pt"})
    os.replace(out / "model.safetensors.partial", out / "model.safetensors")


def block_diffusion_loss(model: Qwen3ForCausalLM, items: list[tuple[list[int], list[int]]], block_size: int,
                         pad_id: int, mask_id: int, eps: float, generator: torch.Generator):
    """Mean cross-entropy over masked positions, and the number of real (non-padding) tokens."""
    clean, eligible = collate(items, block_size, pad_id)  # [b, L], [b, L]
    noisy, masked = mask_blocks(clean, eligible, block_size, mask_id, eps, generator)
    device = model.device
    clean, noisy, masked = clean.to(device), noisy.to(device), masked.to(device)
    # The noisy copy of prompt blocks (before the first block any row may mask) is skipped.
    start = int(eligible.float().argmax(dim=1).min()) // block_size * block_size
    hidden = noisy_hidden_states(model, noisy, clean, block_size, start)  # [b, L - start, hidden]
    loss = F.cross_entropy(model.lm_head(hidden[masked[:, start:]]), clean[masked])
    return loss, sum(len(prompt) + len(response) for prompt, response in items)


def autoregressive_loss(model: Qwen3ForCausalLM, items: list[tuple[list[int], list[int]]],
                        pad_id: int):
    """Next-token cross-entropy on the response targets under the plain causal mask (the
    warm start SDAR inherits from its autoregressive base model)."""
    clean, eligible = collate(items, 1, pad_id)  # [b, L], [b, L]
    clean, eligible = clean.to(model.device), eligible.to(model.device)
    hidden = model.model(input_ids=clean[:, :-1]).last_hidden_state  # [b, L - 1, hidden]
    targets = eligible[:, 1:]
    loss = F.cross_entropy(model.lm_head(hidden[targets]), clean[:, 1:][targets])
    return loss, sum(len(prompt) + len(response) for prompt, response in items)


def make_optimizer(model: Qwen3ForCausalLM, config: TrainConfig) -> torch.optim.AdamW:
    # No weight decay on norm gains.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def train(config: TrainConfig, size: ModelSize) -> None:
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    rng, generator = random.Random(config.seed), torch.Generator().manual_seed(config.seed)
    check_attention_mask()
    if config.init is not None:  # the checkpoint's own tokenizer, whatever the corpus is now
        tokenizer = PreTrainedTokenizerFast.from_pretrained(config.init)
    else:
        tokenizer = build_tokenizer(train_examples())
    data = tokenize_corpus(tokenizer, dict(config.family_weights) or None)
    sdar = {**sdar_config(size, tokenizer), "torch_dtype": config.save_dtype}
    pad_id, mask_id = sdar["pad_token_id"], sdar["mask_token_id"]
    model = Qwen3ForCausalLM(qwen3_config_from_sdar(sdar)).train()
    if config.init is not None:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(config.init / "model.safetensors"))
        print(f"continuing from {config.init}")
    model.to(config.device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M parameters, {asdict(size)}; {len(data)} training examples")
    batch_iter = batches([len(p) + len(r) for p, r in data], config.batch_size, rng)
    retrieval_iter = retrieval_batches(tokenizer, config, random.Random(config.seed + 1))

    def next_items():
        if rng.random() < config.retrieval_fraction:
            return next(retrieval_iter)
        return [data[i] for i in next(batch_iter)]

    save = functools.partial(save_checkpoint, model, tokenizer, sdar, config.out)
    if config.ar_minutes:
        print(f"autoregressive warm start: {config.ar_minutes} minutes")
        optimize(model, lambda items: autoregressive_loss(model, items, pad_id), next_items,
                 config, config.ar_minutes, config.ar_max_steps, save, "--ar-max-steps")
        save()
        print("block-diffusion training")
    optimize(model, lambda items: block_diffusion_loss(
        model, items, rng.choice(config.block_sizes), pad_id, mask_id, config.mask_eps, generator),
        next_items, config, config.minutes, config.max_steps, save, "--max-steps")
    model.eval()
    save()
    print(f"saved checkpoint to {config.out}")
    model.cpu()  # the held-out check decodes on the CPU
    if config.eval_per_family:
        held_out = eval_examples(config.eval_per_family)
        if config.retrieval_fraction:
            held_out += retrieval_examples(config.eval_per_family, 777, (100, 600))
        accuracy = evaluate(model, tokenizer, held_out, mask_id=mask_id,
                            stop_ids=[sdar["eos_token_id"], pad_id], block_size=SERVING_BLOCK_SIZE, show=3)
        print(f"held-out accuracy, greedy, block {SERVING_BLOCK_SIZE}: "
              + ", ".join(f"{family} {value:.2f}" for family, value in accuracy.items()))


def optimize(model: Qwen3ForCausalLM, loss_fn, next_items, config: TrainConfig, minutes: float,
             max_steps: int | None, save, steps_flag: str) -> None:
    """AdamW with warm-up and cosine decay over ``max_steps`` (default: estimated from the
    speed of the first steps to fill ``minutes``); stops at the step count or the time."""
    optimizer = make_optimizer(model, config)
    total_steps = max_steps if max_steps is not None else 10**9
    budget_s, started = minutes * 60, time.perf_counter()
    last_save, window_loss, window_tokens, window_start, step = started, 0.0, 0, started, 0
    timed_from = started
    window_extras: dict[str, float] = {}
    while step < total_steps and time.perf_counter() - started < budget_s:
        # (loss, tokens) or (loss, tokens, {name: value} more figures to log as means)
        loss, num_tokens, *more = loss_fn(next_items())
        for name, value in (more[0] if more else {}).items():
            window_extras[name] = window_extras.get(name, 0.0) + value
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, total_steps, config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        step += 1
        window_loss, window_tokens = window_loss + loss.item(), window_tokens + num_tokens
        now = time.perf_counter()
        if step == config.estimate_after // 4:
            timed_from = now  # the first steps (allocation, CUDA's kernel loading) excluded
        if step == config.estimate_after and max_steps is None:
            pace = (now - timed_from) / (step - config.estimate_after // 4)  # s per step
            total_steps = step + int((budget_s - (now - started)) / pace)
            print(f"cosine schedule set to {total_steps} steps (pass {steps_flag} {total_steps} to reproduce)")
        if step % config.log_every == 0:
            print(f"step {step:6d}  loss {window_loss / config.log_every:.4f}  "
                  + "".join(f"{name} {value / config.log_every:.4f}  "
                            for name, value in window_extras.items())
                  + f"lr {optimizer.param_groups[0]['lr']:.2e}  "
                  f"tok/s {window_tokens / (now - window_start):6.0f}  "
                  f"elapsed {now - started:6.0f}s", flush=True)
            window_loss, window_tokens, window_start, window_extras = 0.0, 0, now, {}
        if now - last_save > config.checkpoint_minutes * 60:
            save()
            last_save = now
    print(f"trained {step} steps in {time.perf_counter() - started:.0f}s")


def parse_family_weight(text: str) -> tuple[str, float]:
    family, sep, weight = text.partition("=")
    if not sep:
        raise SystemExit(f"--family-weight wants FAMILY=WEIGHT, got {text!r}")
    return family, float(weight)


def model_size(args: argparse.Namespace) -> ModelSize:
    """The size flags given, else the --init checkpoint's, else the defaults. A flag that
    contradicts the --init checkpoint is an error (its weights would not load)."""
    base = asdict(ModelSize())
    if args.init is not None:
        saved = json.loads((args.init / "config.json").read_text())
        base.update({field: saved[field] for field in base if field in saved})
    for field in base:
        given = getattr(args, field)
        if given is None:
            continue
        if args.init is not None and given != base[field] and field != "max_position_embeddings":
            raise SystemExit(f"--{field.replace('_', '-')} {given} contradicts {args.init} "
                             f"({base[field]})")
        base[field] = given
    return ModelSize(**base)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--minutes", type=float, default=55.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--eval-per-family", type=int, default=TrainConfig.eval_per_family)
    parser.add_argument("--ar-minutes", type=float, default=0.0,
                        help="autoregressive warm start before block-diffusion training")
    parser.add_argument("--ar-max-steps", type=int, default=None)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES),
                        help="block sizes drawn uniformly per batch")
    parser.add_argument("--init", type=Path, default=None,
                        help="continue from the weights of a checkpoint this script saved")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"),
                        default="float32", help="dtype of the saved weights")
    parser.add_argument("--retrieval-fraction", type=float, default=0.0,
                        help="share of steps on long-prompt retrieval batches")
    parser.add_argument("--retrieval-words", type=int, nargs=2, default=list(TrainConfig.retrieval_words),
                        metavar=("MIN", "MAX"), help="retrieval passage length range in words")
    parser.add_argument("--retrieval-batch-tokens", type=int, default=TrainConfig.retrieval_batch_tokens)
    parser.add_argument("--family-weight", action="append", default=[], metavar="FAMILY=W",
                        help="override a family's sampling weight (repeatable), e.g. range=3")
    for field, default in asdict(ModelSize()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=None,
                            help=f"default {default}, or the --init checkpoint's")
    args = parser.parse_args()
    size = model_size(args)
    config = TrainConfig(out=args.out, minutes=args.minutes, seed=args.seed, threads=args.threads,
                         max_steps=args.max_steps, batch_size=args.batch_size, lr=args.lr,
                         eval_per_family=args.eval_per_family, init=args.init,
                         ar_minutes=args.ar_minutes, ar_max_steps=args.ar_max_steps,
                         block_sizes=tuple(args.block_sizes), device=args.device,
                         save_dtype=args.save_dtype, retrieval_fraction=args.retrieval_fraction,
                         retrieval_words=tuple(args.retrieval_words),
                         retrieval_batch_tokens=args.retrieval_batch_tokens,
                         family_weights=tuple(parse_family_weight(w) for w in args.family_weight))
    train(config, size)


if __name__ == "__main__":
    main()
