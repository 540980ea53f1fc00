"""A short offline run through vLLM's ``LLM`` API: the README's main job.

Generates for a batch of prompts of mixed lengths and reports, as JSON, the numbers that
do not depend on hardware (denoising steps per block, tokens committed per step, model
positions computed per committed token) next to the wall time.

    python benchmarks/offline_run.py [--model DIR] [--block-size 4] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: embedded model)")
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--policy", default="standard")
    parser.add_argument("--strategy", default="low_confidence_dynamic")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--out", default="results/offline_run.json")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion.offline import stats_delta

    model = args.model or str(default_model_path())
    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, max_model_len=1024,
              max_num_seqs=args.max_num_seqs,
              additional_config={"diffusion_policy": args.policy,
                                 "diffusion_block_size": args.block_size,
                                 "strategy": args.strategy, "threshold": args.threshold})
    tokenizer = llm.get_tokenizer()
    rng = random.Random(0)
    words = "the a river town market bread music night question answer light road".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))
               for _ in range(args.num_prompts)]
    messages = [[{"role": "user", "content": p}] for p in prompts]
    if tokenizer.chat_template:
        prompts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                   for m in messages]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    before = llm.collective_rpc("diffusion_stats")[0]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])

    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    report = {
        "model": model,
        "policy": args.policy,
        "block_size": args.block_size,
        "strategy": args.strategy,
        "threshold": args.threshold,
        "requests": len(prompts),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": output_tokens,
        **stats,
        "wall_time_s": round(wall, 3),
        "output_tokens_per_s": round(output_tokens / wall, 1),
        "sample": {"prompt": prompts[0], "output": outputs[0].outputs[0].text},
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
