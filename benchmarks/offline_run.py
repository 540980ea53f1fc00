"""A short offline run through vLLM's ``LLM`` API.

Generates greedily for chat-formatted prompts of the evaluation split and reports, as
JSON, the numbers that do not depend on hardware (denoising steps per block, tokens
committed per step, block positions computed per committed token) next to the wall time.

    python benchmarks/offline_run.py [--model DIR] [--block-size 4] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import json

import harness


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/offline_run.json", max_tokens=96)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--policy", default="standard")
    parser.add_argument("--options", default="{}", help="policy options as JSON")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    args = parser.parse_args()

    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples
    from vllm_diffusion_lab.quality.harness import chat_prompts

    model = harness.model_path(args)
    with diffusion_llm(model, diffusion_block_size=args.block_size, max_model_len=1024,
                       max_num_seqs=args.max_num_seqs,
                       additional_config={"diffusion_policy": args.policy,
                                          **json.loads(args.options)}) as llm:
        prompts = chat_prompts(llm.get_tokenizer(), mixed_eval_examples(args.num_prompts))
        run = harness.generate(llm, prompts, SamplingParams(temperature=0,
                                                            max_tokens=args.max_tokens),
                               counters=True)
    outputs, wall, output_tokens = run.outputs, run.seconds, run.output_tokens
    report = {
        "model": model, "policy": args.policy, "options": json.loads(args.options),
        "block_size": args.block_size, "requests": len(prompts),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": output_tokens, **run.stats,
        "wall_time_s": round(wall, 3), "output_tokens_per_s": round(output_tokens / wall, 1),
        "sample": {"prompt": prompts[0], "output": outputs[0].outputs[0].text},
    }
    harness.write_report(report, args.out)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
