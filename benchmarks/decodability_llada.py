"""Does the importance delta predict which masked tokens get decoded, on a full-attention
LLaDA-format model? (FOCUS Fig. 4 / 13, outside the serving engine)

The plain-PyTorch counterpart of ``decodability_study.py`` for ``LLaDAModelLM``
(``vllm_diffusion_lab.training.llada_format``), which the engine cannot load yet. It runs
LLaDA's published ``generate.py`` loop greedily (a copy of ``llada_format.generate``:
low_confidence remasking, a canvas of ``--gen-length`` masks after the prompt, blocks of
``--block-length``, ``--steps`` forwards, by default one token per step) on the held-out
evaluation prompts (chat template, as ``quality.harness.chat_prompts``), and records at every
step, for each candidate, its absolute position, FOCUS's importance I0 and I1 (Eq. 2-3,
``kernels.importance.candidate_importance``, scale 1/sqrt(head_dim), pool kernel 3) at
layers 0 and 1, delta = I1 - I0, and whether the position was decoded that step. The
analysis, the answer-position cut and the plot are ``decodability_study``'s.

Choices the paper does not make (FOCUS is defined for block diffusion, where a block's
masked positions are both what the model attends among and what is decoded):
- Candidates are the masked positions of the current semi-autoregressive block (LLaDA's
  ``block_length``), ordered by position, even though LLaDA attends fully (every position
  sees the prompt, all blocks and the later masks). The importance is still computed among
  the candidates only, from their q and k (after RoPE) in the forward over the whole canvas;
  masks of later blocks are neither candidates nor keys.
- Max-pooling neighbours are adjacent candidates (the compacted list), as in the engine.
- The answer's end is the first ``<|im_end|>`` or ``<|endoftext|>`` of the final canvas, the
  end token itself included (as the engine's output token ids include it); without one,
  the whole canvas counts as answer.
- A step whose quota is 0 (only when --steps is not gen_length) runs no forward here and is
  not recorded (LLaDA runs the forward and commits nothing).

    python benchmarks/decodability_llada.py [--model DIR] [--per-family 20]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from decodability_study import analyse, answer_positions_only, plot, print_report
from vllm_diffusion_lab.training.llada_format import LLaDAModelLM, generate, rotate_half

from vllm_diffusion.kernels.importance import candidate_importance

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "checkpoints/llada-small-chat"
LAYERS = (0, 1)
POOL_KERNEL = 3


def rope_qk(block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [L, H, D] and k [L, H_kv, D] after RoPE of one block's input x [1, L, d], as
    ``llada_format.Block.forward`` computes them."""
    normed = block.attn_norm(x)[0]
    q = block.q_proj(normed).view(-1, block.heads, block.head_dim).transpose(0, 1)
    k = block.k_proj(normed).view(-1, block.kv_heads, block.head_dim).transpose(0, 1)
    q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
    k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
    return q.transpose(0, 1), k.transpose(0, 1)


@torch.no_grad()
def decode_recording(model: LLaDAModelLM, prompt_ids: list[int], *, mask_id: int,
                     gen_length: int = 128, block_length: int = 32, steps: int | None = None):
    """``llada_format.generate`` (same arguments, same canvas) plus one record per forward:
    {"block", "positions", "layer0", "layer1", "delta", "decoded"} over the candidates."""
    start = len(prompt_ids)
    blocks = model.model.transformer.blocks
    inputs: dict[int, tuple] = {}  # layer -> (x, cos, sin) of the current forward
    hooks = [blocks[layer].register_forward_pre_hook(
        lambda module, args, layer=layer: inputs.__setitem__(layer, args[:3])) for layer in LAYERS]
    scale = 1.0 / math.sqrt(blocks[0].head_dim)
    records = []

    def record(masked: torch.Tensor, chosen: torch.Tensor, block_start: int, block_end: int):
        # the candidates: the block's masked positions before this step's commit
        candidates = block_start + masked[block_start:block_end].nonzero()[:, 0]
        importance = []
        for layer in LAYERS:
            q, k = rope_qk(blocks[layer], *inputs[layer])
            importance.append(candidate_importance(q[candidates], k[candidates], scale,
                                                   POOL_KERNEL))
        decoded = torch.zeros(len(masked), dtype=torch.bool, device=masked.device)
        decoded[chosen] = True
        records.append({"block": (block_start - start) // block_length,
                        "positions": candidates.tolist(),
                        "layer0": importance[0].tolist(), "layer1": importance[1].tolist(),
                        "delta": (importance[1] - importance[0]).tolist(),
                        "decoded": decoded[candidates].tolist()})

    try:
        canvas = generate(model, prompt_ids, mask_id=mask_id, gen_length=gen_length,
                          block_length=block_length, steps=steps, on_step=record)
    finally:
        for hook in hooks:
            hook.remove()
    return canvas, records


def load(directory: pathlib.Path) -> tuple[LLaDAModelLM, dict]:
    from safetensors.torch import load_file

    config = json.loads((directory / "config.json").read_text())
    model = LLaDAModelLM(config)
    model.load_state_dict({n: t.float() for n, t in load_file(directory / "model.safetensors").items()})
    return model.eval(), config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--gen-length", type=int, default=128)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=None, help="default: gen_length")
    parser.add_argument("--per-family", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/decodability_llada.json")
    parser.add_argument("--plot", default="results/decodability_llada.png")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import PreTrainedTokenizerFast
    from vllm_diffusion_lab.quality.corpus import eval_examples, score
    from vllm_diffusion_lab.quality.harness import chat_prompts
    from vllm_diffusion_lab.training.tokenizer import ENDOFTEXT, IM_END

    model_dir = pathlib.Path(args.model) if args.model else DEFAULT_MODEL
    if not (model_dir / "model.safetensors").is_file():
        sys.exit(f"no LLaDA-format checkpoint at {model_dir} (pass --model DIR)")
    model, config = load(model_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    stop_ids = set(tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT]))
    examples = eval_examples(args.per_family)
    records, answer_ends, correct = [], {}, 0
    for index, (example, prompt) in enumerate(zip(examples, chat_prompts(tokenizer, examples))):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        canvas, steps = decode_recording(model, prompt_ids, mask_id=config["mask_token_id"],
                                         gen_length=args.gen_length,
                                         block_length=args.block_length, steps=args.steps)
        stops = [i for i, token in enumerate(canvas) if token in stop_ids]
        answer_ends[f"prompt{index}"] = len(prompt_ids) + (stops[0] + 1 if stops else len(canvas))
        records += [{**r, "req_id": f"prompt{index}-0"} for r in steps]
        answer = tokenizer.decode(canvas[:stops[0] if stops else None], skip_special_tokens=True)
        correct += score(example.family, example.answer, answer)
        print(f"[{index + 1}/{len(examples)}] {example.family}: {len(steps)} steps, "
              f"answer {answer_ends[f'prompt{index}'] - len(prompt_ids)} tokens", flush=True)
    report = {"model": str(model_dir), "model_name": model_dir.name,
              "block_size": args.block_length, "gen_length": args.gen_length,
              "denoising_steps": args.steps or args.gen_length, "candidates_are": "current block's masks",
              "prompts": len(examples), "accuracy": correct / max(len(examples), 1),
              **analyse(records),
              "answer_positions": analyse(answer_positions_only(records, answer_ends))}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    pathlib.Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot(report, pathlib.Path(args.plot))
    print(f"accuracy {report['accuracy']:.3f} over {len(examples)} prompts")
    print_report(report)

if __name__ == "__main__":
    main()
