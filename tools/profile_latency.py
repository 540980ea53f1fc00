"""Profile a model's denoising-step latency on this machine for the elastic policy.

Runs greedy requests through the in-process engine with the standard policy at every
chunk size of the block and several batch sizes, records for each engine step the rows
the model computed and the wall time of the runner's ``execute_model``, fits the
three-regime piecewise-affine latency model (``policies/latency_model.py``) and writes it
as JSON, with the model's shape so the engine can refuse a profile of another model.

    python tools/profile_latency.py --model DIR --out latency.json [--block-size 32]

Then: ``--additional-config '{"diffusion_policy": "elastic", "latency_profile":
"latency.json"}'`` (or ``LLM(additional_config=...)``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: embedded model)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from vllm import SamplingParams

    from vllm_diffusion.default_model import embedded_model_path
    from vllm_diffusion.policies.elastic.latency_model import fit_piecewise, model_identity
    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples
    from vllm_diffusion_lab.quality.harness import chat_prompts

    model = args.model or str(embedded_model_path())
    block = args.block_size
    chunks = [c for c in range(1, block + 1) if block % c == 0 and c & (c - 1) == 0]
    by_rows: dict[int, list[float]] = {}
    with diffusion_llm(model, diffusion_block_size=block, max_model_len=1024,
                       max_num_seqs=max(args.batch_sizes)) as llm:
        runner = (llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
                  .worker.model_runner)
        identity = model_identity(llm.llm_engine.vllm_config.model_config.hf_config)
        execute = runner.execute_model

        def timed(*a, **k):
            rows = runner.diffusion_stats.positions_computed
            start = time.perf_counter()
            out = execute(*a, **k)
            seconds = time.perf_counter() - start
            rows = runner.diffusion_stats.positions_computed - rows
            if rows:
                by_rows.setdefault(rows, []).append(seconds)
            return out

        prompts = chat_prompts(llm.get_tokenizer(), mixed_eval_examples(max(args.batch_sizes)))
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        runner.execute_model = timed
        for chunk in chunks:
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                    extra_args={"chunk_size": chunk, "chunk_reuse": True})
            for batch in args.batch_sizes:
                llm.generate(prompts[:batch], params, use_tqdm=False)
                print(f"chunk {chunk}, batch {batch}: {len(by_rows)} row counts seen",
                      flush=True)
        runner.execute_model = execute
    samples = [(rows, statistics.median(times)) for rows, times in sorted(by_rows.items())]
    profile = fit_piecewise(samples, identity)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(profile.to_json() + "\n")
    print(json.dumps({"breaks": profile.breaks, "slopes_ms_per_row":
                      [1e3 * s for s in profile.slopes], "intercepts_ms":
                      [1e3 * i for i in profile.intercepts], "samples": len(samples)}))


if __name__ == "__main__":
    main()
