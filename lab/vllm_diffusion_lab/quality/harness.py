"""Quality harness: the evaluation split through the plugin's ``LLM`` API.

For each block size and each policy option set, generates greedily for every evaluation
problem (chat template), scores exact match per task family, and reports accuracy next to
tokens committed per denoising step, block positions computed per committed token (through
layers 0-1, and through the later layers after a policy's eviction), all positions computed
per committed token (prompt prefill and block commits included) and wall time, as JSON.

    python -m vllm_diffusion_lab.quality.harness --block-sizes 4 8 16 32 \
        --options '{"threshold": 0.9}' '{"threshold": 0.7}' --per-family 20
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time
from collections import defaultdict
from typing import Any

from vllm_diffusion_lab.quality.corpus import CHECKED_FAMILIES, eval_examples, score

INSTRUCTION_FAMILIES = tuple(f for f in CHECKED_FAMILIES if f != "arithmetic")


def chat_prompts(tokenizer: Any, examples: list) -> list[str]:
    """Each example's prompt as a user turn in the model's chat template."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": e.prompt}],
                                          tokenize=False, add_generation_prompt=True)
            for e in examples]


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sensible at 0 and n successes)."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return round(max(0.0, centre - half), 3), round(min(1.0, centre + half), 3)


def evaluate(llm: Any, examples: list, options: dict[str, Any], max_tokens: int) -> dict:
    """Accuracy per family and the work done, for per-request options on an open engine."""
    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import stats_delta

    prompts = chat_prompts(llm.get_tokenizer(), examples)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=options or None)
    before = llm.collective_rpc("diffusion_stats")[0]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])

    correct: dict[str, list[bool]] = defaultdict(list)
    for example, out in zip(examples, outputs):
        correct[example.family].append(score(example.family, example.answer, out.outputs[0].text))
    accuracy = {family: sum(v) / len(v) for family, v in sorted(correct.items())}
    instructions = [ok for f in INSTRUCTION_FAMILIES for ok in correct.get(f, [])]
    return {
        "accuracy": accuracy,
        "correct": {family: [sum(v), len(v)] for family, v in sorted(correct.items())},
        "interval_95": {family: wilson_interval(sum(v), len(v)) for family, v in sorted(correct.items())},
        "instruction_accuracy": sum(instructions) / max(len(instructions), 1),
        "instruction_interval_95": wilson_interval(sum(instructions), len(instructions)),
        # per problem, in evaluation-split order: paired comparisons between option sets
        "correct_by_problem": {family: [int(ok) for ok in v] for family, v in sorted(correct.items())},
        "requests": len(prompts),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "tokens_committed_per_denoising_step": stats["tokens_committed_per_denoising_step"],
        "block_positions_per_committed_token": stats["block_positions_per_committed_token"],
        "later_layer_positions_per_committed_token":
            stats["later_layer_positions_per_committed_token"],
        "layer_positions_per_committed_token": stats["layer_positions_per_committed_token"],
        "all_positions_per_committed_token": stats["all_positions_per_committed_token"],
        "denoising_steps_per_block": stats["denoising_steps_per_block"],
        "wall_time_s": round(wall, 3),
        "samples": [{"prompt": e.prompt, "expected": e.answer, "got": o.outputs[0].text}
                    for e, o in list(zip(examples, outputs))[:3]],
    }


def engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options of a set that only an engine can take (policy, engine-wide options)."""
    from vllm_diffusion.config import ENGINE_KEYS
    from vllm_diffusion.policies import POLICIES

    policy = POLICIES[options.get("diffusion_policy", "standard")]
    engine_only = (*ENGINE_KEYS, *getattr(policy.config_cls, "engine_only", ()))
    return {"diffusion_policy": policy.name,
            **{k: v for k, v in options.items() if k in engine_only}}


def run(model: str, block_sizes: list[int], option_sets: list[dict[str, Any]],
        per_family: int, max_tokens: int = 128) -> list[dict]:
    from vllm_diffusion_lab.offline import diffusion_llm

    examples = eval_examples(per_family)
    engines: list[dict[str, Any]] = []
    for options in option_sets:
        if engine_options(options) not in engines:
            engines.append(engine_options(options))
    runs = []
    for block_size in block_sizes:
        for engine in engines:
            delayed = engine.get("commit") == "delayed"  # approximate KV: no prefix cache
            with diffusion_llm(model, diffusion_block_size=block_size, max_model_len=1024,
                               max_num_seqs=32, enable_prefix_caching=not delayed,
                               additional_config=engine) as llm:
                for options in option_sets:
                    if engine_options(options) != engine:
                        continue
                    request_options = {k: v for k, v in options.items() if k not in engine}
                    result = evaluate(llm, examples, request_options, max_tokens)
                    runs.append({"block_size": block_size, "policy": engine["diffusion_policy"],
                                 "options": options, **result})
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: embedded model)")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4])
    parser.add_argument("--options", nargs="+", default=["{}"],
                        help="JSON option sets, e.g. '{\"threshold\": 0.7}'")
    parser.add_argument("--per-family", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="results/quality.json")
    args = parser.parse_args()

    from vllm_diffusion.default_model import embedded_model_path

    model = args.model or str(embedded_model_path())
    runs = run(model, args.block_sizes, [json.loads(o) for o in args.options],
               args.per_family, args.max_tokens)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "per_family": args.per_family, "runs": runs},
                              indent=2) + "\n")
    for r in runs:
        print(f"block {r['block_size']:>2} {r['policy']} {json.dumps(r['options'])}: "
              + ", ".join(f"{f} {a:.2f}" for f, a in r["accuracy"].items())
              + f" | instructions {r['instruction_accuracy']:.2f} {r['instruction_interval_95']}"
              + f" | tokens/step {r['tokens_committed_per_denoising_step']:.2f}"
              f" | positions/token {r['block_positions_per_committed_token']:.2f}"
              f" (later layers {r['later_layer_positions_per_committed_token']:.2f})"
              f" | {r['wall_time_s']:.1f}s")


if __name__ == "__main__":
    main()
