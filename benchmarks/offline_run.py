"""A short offline run through vLLM's ``LLM`` API.

Generates greedily for chat-formatted prompts of the evaluation split and reports, as
JSON, the numbers that do not depend on hardware (denoising steps per block, tokens
committed per step, block positions computed per committed token) next to the wall time.

    python benchmarks/offline_run.py [--model DIR] [--block-size 4] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: embedded model)")
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--policy", default="standard")
    parser.add_argument("--options", default="{}", help="policy options as JSON")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--out", default="results/offline_run.json")
    args = parser.parse_args()

    from vllm import SamplingParams

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion_lab.offline import diffusion_llm, stats_delta
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples
    from vllm_diffusion_lab.quality.harness import chat_prompts

    model = str(args.model or default_model_path())
    with diffusion_llm(model, diffusion_block_size=args.block_size, max_model_len=1024,
                       max_num_seqs=args.max_num_seqs,
                       additional_config={"diffusion_policy": args.policy,
                                          **json.loads(args.options)}) as llm:
        prompts = chat_prompts(llm.get_tokenizer(), mixed_eval_examples(args.num_prompts))
        before = llm.collective_rpc("diffusion_stats")[0]
        start = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens),
                               use_tqdm=False)
        wall = time.perf_counter() - start
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    report = {
        "model": model, "policy": args.policy, "options": json.loads(args.options),
        "block_size": args.block_size, "requests": len(prompts),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": output_tokens, **stats,
        "wall_time_s": round(wall, 3), "output_tokens_per_s": round(output_tokens / wall, 1),
        "sample": {"prompt": prompts[0], "output": outputs[0].outputs[0].text},
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
