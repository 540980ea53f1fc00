"""How much of an ES-dLLM step goes to ES-dLLM's own skipping (the importance of Eq. 1,
the ranking, the cache update)?

Times, inside one ES-dLLM run at vLLM's default compilation, the step's hook set-up and
its skip-layer hooks (``step_timing.StepClock`` on their class), against the wall time of
the whole run (every request generating ``--max-tokens`` tokens, ``ignore_eos``).

    python benchmarks/es_overhead.py [--block-size B] [--batch-size 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json

import harness
from step_timing import StepClock, share_of_wall, share_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/es_overhead.json", rounds=3, max_tokens=64, model_default="default")
    parser.add_argument("--block-size", type=int, default=None,
                        help="default: the model's own")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    from vllm import SamplingParams

    from vllm_diffusion.policies import es
    from vllm_diffusion_lab.offline import diffusion_llm

    clock = StepClock()
    clock.wrap(es.EsHooks, "__init__", "hook_setup")
    clock.wrap(es.EsHooks, "after_output", "skip_layers")
    model = harness.model_path(args)
    args.block_size = args.block_size or harness.model_config(model).block_size
    with diffusion_llm(model, diffusion_block_size=args.block_size, max_model_len=1024,
                       max_num_seqs=args.batch_size, enforce_eager=False,
                       additional_config={"diffusion_policy": "es"}) as llm:
        prompts = harness.scored_prompts(model, llm.get_tokenizer(), args.batch_size).prompts
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        reports = share_of_wall(llm, prompts, params, args.rounds, clock)
    report = share_report({"model": model, "block_size": args.block_size,
                           "batch_size": args.batch_size}, reports)
    harness.write_report(report, args.out)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
