"""Row-dropping policies against `standard`, all compiled, side by side: throughput and the
row-layers each computes, so a policy's speed-up can be read against its ideal.

For one block size, each policy (same strategy and threshold: `threshold`, 0.8 by
default) runs in its own engine at vLLM's default compilation, the policies alternating
within each of ``--rounds`` rounds; every batch size submits that many requests at once,
each generating exactly ``--max-tokens`` tokens (``ignore_eos``), and tokens/s is the
median over the rounds. Row-layers per committed token: every row each layer computed
(prefill and block commits through every layer, block positions through the layers they
reached), from the engine's counters. A policy's ideal speed-up over `standard` is the
ratio of the two row-layer figures; "of ideal" is the measured speed-up over it.

``--shape embedded``: the default model with chat prompts of the evaluation split.
``--shape large``: a compute-bound random SDAR (12 layers, hidden 768; written to
``results/large-random-sdar``) with random 64-token prompts.

    python benchmarks/compiled_hooks.py --shape large --batch-sizes 8 --rounds 3
    python benchmarks/compiled_hooks.py --batch-sizes 16 32 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
LARGE_SHAPE = {"num_layers": 12, "hidden_size": 768, "num_heads": 12, "num_kv_heads": 4,
               "head_dim": 64, "block_size": 32}
LARGE_MODEL = ROOT / "results/large-random-sdar"


def row_layers_per_token(stats: dict, num_layers: int) -> float:
    """Rows times layers computed per committed token."""
    block = sum(stats["block_positions_per_layer"])
    other = stats["positions_computed"] - stats["block_positions_computed"]
    return (block + other * num_layers) / max(stats["tokens_committed"], 1)


def workload(shape: str, llm, count: int) -> list:
    import random

    from vllm.inputs import TokensPrompt

    from vllm_diffusion_lab.quality.corpus import eval_examples
    from vllm_diffusion_lab.quality.harness import chat_prompts

    if shape == "embedded":
        prompts = chat_prompts(llm.get_tokenizer(), eval_examples(20))
        return [prompts[i % len(prompts)] for i in range(count)]
    rng = random.Random(0)
    vocab = llm.llm_engine.vllm_config.model_config.hf_config.vocab_size
    return [TokensPrompt(prompt_token_ids=[rng.randrange(16, vocab) for _ in range(64)])
            for _ in range(count)]


def run_cell(llm, prompts: list, max_tokens: int, options: dict) -> dict:
    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import stats_delta

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=options)
    before = llm.collective_rpc("diffusion_stats")[0]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens_per_s": tokens / wall, "stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("embedded", "large"), default="embedded")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--policies", nargs="+", default=["standard", "focus", "es"])
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="every engine eager")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "results/compiled_hooks.json")
    args = parser.parse_args()

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion_lab.offline import diffusion_llm

    if args.shape == "large":
        from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar

        model = (LARGE_MODEL if (LARGE_MODEL / "config.json").exists()
                 else build_tiny_sdar(LARGE_MODEL, **LARGE_SHAPE))
    else:
        model = default_model_path()
    options = {"strategy": "threshold", "threshold": args.threshold}
    speeds: dict = {}
    work: dict = {}
    startup: dict = {}
    for round_index in range(args.rounds):
        for policy in args.policies:
            start = time.perf_counter()
            with diffusion_llm(model, diffusion_block_size=args.block_size,
                               max_model_len=1024, max_num_seqs=max(args.batch_sizes),
                               enforce_eager=args.eager,
                               additional_config={"diffusion_policy": policy}) as llm:
                num_layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
                prompts = workload(args.shape, llm, max(args.batch_sizes))
                # the first forward with hooks compiles the pieces: a warm-up request
                run_cell(llm, prompts[:2], args.block_size, options)
                startup.setdefault(policy, []).append(time.perf_counter() - start)
                for batch in args.batch_sizes:
                    cell = run_cell(llm, prompts[:batch], args.max_tokens, options)
                    speeds.setdefault((policy, batch), []).append(cell["tokens_per_s"])
                    work[(policy, batch)] = row_layers_per_token(cell["stats"], num_layers)
            print(f"round {round_index + 1}: {policy} done", flush=True)
    rows = []
    for batch in args.batch_sizes:
        base_speed = statistics.median(speeds[("standard", batch)])
        for policy in args.policies:
            speed = statistics.median(speeds[(policy, batch)])
            ideal = work[("standard", batch)] / work[(policy, batch)]
            rows.append({"policy": policy, "batch_size": batch, "tokens_per_s": speed,
                         "tokens_per_s_each_round": speeds[(policy, batch)],
                         "row_layers_per_token": work[(policy, batch)],
                         "speedup": speed / base_speed, "ideal_speedup": ideal,
                         "of_ideal": (speed / base_speed) / ideal})
    report = {"shape": args.shape, "block_size": args.block_size, "options": options,
              "rounds": args.rounds, "eager": args.eager, "max_tokens": args.max_tokens,
              "startup_s": startup, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("| policy | batch | tokens/s | row-layers / token | / standard | ideal | of ideal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['batch_size']} | {r['tokens_per_s']:.0f} | "
              f"{r['row_layers_per_token']:.1f} | {r['speedup']:.2f} | {r['ideal_speedup']:.2f} | "
              f"{r['of_ideal']:.2f} |")
    print("start-up with the first compiled forward (s):",
          {p: [round(t, 1) for t in ts] for p, ts in startup.items()})


if __name__ == "__main__":
    main()
