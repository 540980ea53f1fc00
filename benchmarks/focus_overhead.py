"""How much of a FOCUS step goes to FOCUS itself (importance, selection, compaction)?

Times, inside one FOCUS run, FOCUS's forward hooks (the importance computation at layers
0/1 and the selection of the retained set: budget, constraints) and the decoder stack's
row and metadata compaction (``step_timing.StepClock`` on their classes), against the wall
time of the whole run. The paper reports about 1% of step latency on GPUs with
billion-parameter models; on this project's tiny CPU models the model's own compute is
small, so the share here is an upper bound of what larger models would see.

    python benchmarks/focus_overhead.py [--model DIR|embedded] [--block-size B] [--batch-size 32]
        [--compiled] [--rounds 3]

``--compiled``: the engine at vLLM's default compilation (FOCUS's layers between its hook
points run as compiled pieces); eager otherwise. With ``--rounds`` above 1 the generation
is repeated and the report gives each round and the median share.
"""

from __future__ import annotations

import argparse
import json

import harness
from step_timing import StepClock, share_of_wall, share_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/focus_overhead.json", rounds=1,
                               max_tokens=96, model_default="default")
    parser.add_argument("--block-size", type=int, default=None,
                        help="default: the model's own")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args()

    from vllm import SamplingParams

    from vllm_diffusion.models.step_run import StepRun
    from vllm_diffusion.policies.focus import hooks
    from vllm_diffusion.step.rows import StepRows
    from vllm_diffusion_lab.offline import diffusion_llm

    clock = StepClock()
    clock.wrap(hooks.FocusStepHooks, "__init__", "hook_setup")
    clock.wrap(hooks.FocusStepHooks, "before_attention", "importance_and_selection")
    clock.wrap(StepRows, "keep_queries", "metadata_compaction")
    clock.wrap(StepRows, "keep_keys", "metadata_compaction")
    clock.wrap(StepRun, "_keep", "row_compaction")
    model = harness.model_path(args)
    args.block_size = args.block_size or harness.model_config(model).block_size
    with diffusion_llm(model, diffusion_block_size=args.block_size, max_model_len=1024,
                       max_num_seqs=args.batch_size, enforce_eager=not args.compiled,
                       additional_config={"diffusion_policy": "focus"}) as llm:
        prompts = harness.scored_prompts(model, llm.get_tokenizer(), args.batch_size).prompts
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        reports = share_of_wall(llm, prompts, params, args.rounds, clock)
    report = share_report({"model": model, "block_size": args.block_size,
                           "batch_size": args.batch_size, "compiled": args.compiled}, reports)
    harness.write_report(report, args.out)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
