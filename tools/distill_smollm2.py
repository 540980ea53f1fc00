"""The conversion's training data: the original SmolLM2-135M-Instruct's own greedy answers
(stock vLLM, float32) to the training prompts (``real_model/training_prompts.py``), appended
to a JSON-lines file in the cache (resumable: prompts already answered are skipped).

    python tools/distill_smollm2.py --count 4000 [--minutes 20]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

from vllm_diffusion_lab.real_model import original_checkpoint
from vllm_diffusion_lab.real_model.data import distilled_path, excluded_prompts
from vllm_diffusion_lab.real_model.training_prompts import training_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--chunk", type=int, default=128, help="prompts per generate call")
    parser.add_argument("--minutes", type=float, default=None, help="stop after this long")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    out = args.out or distilled_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        done = {json.loads(line)["prompt"] for line in out.read_text().splitlines() if line}
    prompts = [p for p in training_prompts(args.count, args.seed, excluded_prompts())
               if p not in done]
    print(f"{len(done)} answered already, {len(prompts)} to go -> {out}", flush=True)
    model = str(original_checkpoint())
    llm = LLM(model, dtype="float32", max_model_len=1024, max_num_seqs=128, seed=0)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.time()
    for i in range(0, len(prompts), args.chunk):
        chunk = prompts[i:i + args.chunk]
        inputs = [{"prompt_token_ids": tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)}
            for p in chunk]
        inputs = [{"prompt_token_ids": list(x["prompt_token_ids"]["input_ids"]
                                            if hasattr(x["prompt_token_ids"], "keys")
                                            else x["prompt_token_ids"])} for x in inputs]
        results = llm.generate(inputs, params, use_tqdm=False)
        tokens = 0
        with out.open("a") as f:
            for prompt, given, result in zip(chunk, inputs, results):
                completion = result.outputs[0]
                tokens += len(completion.token_ids)
                f.write(json.dumps({"prompt": prompt,
                                    "prompt_ids": given["prompt_token_ids"],
                                    "answer_ids": list(completion.token_ids),
                                    "finished": completion.finish_reason == "stop"}) + "\n")
        elapsed = time.time() - start
        print(f"{i + len(chunk)}/{len(prompts)} prompts, {tokens} tokens in this chunk, "
              f"{elapsed:.0f}s", flush=True)
        if args.minutes and elapsed > args.minutes * 60:
            break


if __name__ == "__main__":
    main()
