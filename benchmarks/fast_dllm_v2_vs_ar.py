"""Fast-dLLM v2 through the plugin, with and without its block cache, against stock vLLM
decoding the same weights autoregressively, at equal work.

The checkpoint is built in code (random weights, the published layout, written to a
temporary directory): the embedded model's shape (12 layers, hidden 256, 4 heads, 2 KV
heads, MLP 768, its tokenizer) with Fast-dLLM v2's ``bd_size`` (``--block``, 32).
Configurations (each engine in this process, one at a time, alternating over
``--rounds``):

- ``fast-dllm-v2``: the family's published settings (sub-blocks of 8, threshold 0.9;
  every step computes the whole block), greedy, ``max_tokens`` (``--max-tokens``),
  ``ignore_eos`` (random weights: a stop token would end requests at random lengths);
- ``fast-dllm-v2 sub_block_cache``: the same with the block cache (the published
  ``use_block_cache``: between refreshes a step computes only the active sub-block);
- ``autoregressive``: the same weights as ``Qwen2ForCausalLM`` (Fast-dLLM v2's network
  is Qwen2's), stock vLLM at its defaults, generating per request exactly as many tokens
  as the plugin did (``ignore_eos``).

Both sides are compiled (stock vLLM's default, the baseline users have; each engine warms
up before it is timed) unless ``--eager``.

For batch size b, b chat prompts are submitted at once, repeated until ``--min-requests``
ran. Reported per batch size: tokens/s (median over rounds), the ratio to autoregressive
decoding, committed tokens per denoising step (per request), and rows computed per
committed token (the plugin's counters; for autoregressive decoding, prompt plus output
tokens per output token). Random weights make the confidences, and so the tokens per
step, unlike a trained checkpoint's. JSON and a PNG.

    python benchmarks/fast_dllm_v2_vs_ar.py [--batch-sizes 1 8 32] [--rounds 3] [--eager]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import tempfile

import harness

PLAIN = "fast-dllm-v2"
CACHED = "fast-dllm-v2 sub_block_cache"
AR = "autoregressive"


def build_checkpoints(into: pathlib.Path, block: int) -> tuple[pathlib.Path, pathlib.Path]:
    """The Fast-dLLM v2 checkpoint of the embedded model's shape, and its Qwen2 twin."""
    from vllm_diffusion.default_model import embedded_model_path
    from vllm_diffusion_lab.fixtures.tiny_fast_dllm_v2 import build_tiny_fast_dllm_v2

    shape = json.loads((pathlib.Path(embedded_model_path()) / "config.json").read_text())
    diffusion = build_tiny_fast_dllm_v2(
        into / "fast-dllm-v2", bd_size=block, num_layers=shape["num_hidden_layers"],
        hidden_size=shape["hidden_size"], num_heads=shape["num_attention_heads"],
        num_kv_heads=shape["num_key_value_heads"],
        intermediate_size=shape["intermediate_size"], max_position_embeddings=4096)
    twin = into / "qwen2"
    shutil.copytree(diffusion, twin)
    config = json.loads((twin / "config.json").read_text())
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    for key in ("bd_size", "mask_token_id", "auto_map"):
        config.pop(key, None)
    (twin / "config.json").write_text(json.dumps(config, indent=2))
    return diffusion, twin


def measure(llm, prompts: list[str], batch: int, min_requests: int, max_tokens: int,
            lengths: list[int] | None, extra: dict | None) -> dict:
    """``lengths``: the autoregressive side's output length per request (equal work);
    ``extra``: the plugin's request options (None: autoregressive)."""
    from vllm import SamplingParams

    diffusion = extra is not None
    tokens = rows = seconds = steps = done = 0
    produced: list[int] = []
    while done < max(min_requests, batch):
        indices = [(done + i) % len(prompts) for i in range(batch)]
        params = (SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                 extra_args=extra) if diffusion
                  else [SamplingParams(temperature=0, max_tokens=max(lengths[done + i], 1),
                                       ignore_eos=True) for i in range(batch)])
        run = harness.generate(llm, [prompts[i] for i in indices], params, counters=diffusion)
        seconds += run.seconds
        for out in run.outputs:
            produced.append(len(out.outputs[0].token_ids))
            if not diffusion:
                rows += len(out.prompt_token_ids) + produced[-1]
        if diffusion:
            rows += run.stats["positions_computed"]
            steps += run.stats["denoising_steps"]
        tokens += run.output_tokens
        done += batch
    return {"tokens_per_s": tokens / seconds, "output_tokens": tokens, "lengths": produced,
            "tokens_per_step": tokens / steps if steps else None,
            "rows_per_committed_token": rows / max(tokens, 1)}


def run_config(name: str, args, models: dict, prompts_of, recorded: dict) -> dict[int, dict]:
    from vllm_diffusion_lab.offline import autoregressive_llm, diffusion_llm

    batch_max = max(args.batch_sizes)
    eager = args.eager
    if name == AR:
        engine = autoregressive_llm(models[AR], max_num_seqs=batch_max, max_model_len=1024,
                                    enforce_eager=eager)
        extra = None
    else:
        engine = diffusion_llm(models[PLAIN], max_model_len=1024, max_num_seqs=batch_max,
                               enforce_eager=eager)
        extra = {"sub_block_cache": name == CACHED}
    results = {}
    with engine as llm:
        prompts = prompts_of(llm.get_tokenizer())
        measure(llm, prompts, 1, 1, 8, [8], extra)  # warm-up
        for batch in args.batch_sizes:
            lengths = recorded[PLAIN][batch] if extra is None else None
            result = measure(llm, prompts, batch, args.min_requests, args.max_tokens,
                             lengths, extra)
            if name == PLAIN:
                recorded.setdefault(name, {})[batch] = result["lengths"]
            results[batch] = result
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/fast_dllm_v2_vs_ar.json",
                               batch_sizes=[1, 8, 32], rounds=3, max_tokens=64, model=False)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--eager", action="store_true",
                        help="both sides eager (default: both compiled)")
    args = parser.parse_args()
    harness.engines_in_process()

    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples
    from vllm_diffusion_lab.quality.harness import chat_prompts

    examples = mixed_eval_examples(max(args.batch_sizes + [args.min_requests]))
    recorded: dict[str, dict[int, list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        diffusion, twin = build_checkpoints(pathlib.Path(tmp), args.block)
        models = {PLAIN: diffusion, AR: twin}
        order = [PLAIN, CACHED, AR]  # the twin after the run whose lengths it repeats
        measured = harness.alternate(order, args.rounds, lambda name: run_config(
            name, args, models, lambda tokenizer: chat_prompts(tokenizer, examples),
            recorded))
    rows = []
    for name, rounds in measured.items():
        for batch, runs in harness.by_batch(rounds).items():
            ar = statistics.median(r[batch]["tokens_per_s"] for r in measured[AR])
            per_step = [r["tokens_per_step"] for r in runs if r["tokens_per_step"]]
            rows.append({**harness.speed_row(name, batch, runs, ar),
                         "tokens_per_step": statistics.mean(per_step) if per_step else None})
    report = {"machine": f"{os.cpu_count()} CPU cores", "compiled": not args.eager,
              "block": args.block,
              "sub_block_size": 8, "threshold": 0.9, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "min_requests": args.min_requests,
              "weights": "random (built in code), the embedded model's shape", "rows": rows,
              "package": harness.package_files()}
    harness.write_report(report, args.out, plot)
    print("| config | batch | tokens/s | / AR | tokens / step | rows / token |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio, per_step = r["ratio_to_autoregressive"], r["tokens_per_step"]
        print(f"| {r['config']} | {r['batch_size']} | {r['tokens_per_s']:.0f} | "
              f"{ratio:.3f} | {'-' if per_step is None else f'{per_step:.2f}'} | "
              f"{r['rows_per_committed_token']:.1f} |")


def plot(report: dict, path: pathlib.Path) -> None:
    harness.plot_speed_and_rows(report, path, dashed=lambda label: label == AR)


if __name__ == "__main__":
    main()
