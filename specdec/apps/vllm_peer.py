"""The peer in ``specdec bench --peer vllm``: vLLM's offline engine on the same weights and prompts.

Run by the bench as a script with the peer's own Python (vLLM pins other versions of torch and
transformers than specdec, so it lives in its own venv: ``make bench-peer``); it imports nothing of
specdec. Input: a JSON file {"model": float32 checkpoint dir, "prompts": [[token ids]...],
"levels": [1, 4, 16], "max_tokens": 96, "repeats": 2, "dtype": "bfloat16"} (dtype: what vLLM
loads the weights as, float32 when absent); output: the same file's path + ".out", with
per level the median tokens/s of ``level`` prompts generated together (greedy, natural EOS) and the
token ids each prompt got alone (level 1), for the bench to check against its own.

The engine must be created under ``if __name__ == "__main__":`` (it spawns its engine process).
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main(path: str) -> int:
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]  # only in the peer's venv
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    job = json.loads(open(path).read())  # noqa: SIM115 - read once
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), max_model_len=2048, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    llm.generate(prompts[:1], greedy, use_tqdm=False)  # warm-up
    alone = [list(out.outputs[0].token_ids) for p in prompts for out in llm.generate([p], greedy, use_tqdm=False)]
    levels = []
    for level in job["levels"]:
        rates = []
        for _ in range(job.get("repeats", 1)):
            batch = [prompts[i % len(prompts)] for i in range(level)]
            started = time.perf_counter()
            outs = llm.generate(batch, greedy, use_tqdm=False)
            wall = time.perf_counter() - started
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
        levels.append({"concurrency": level, "aggregate_tokens_per_s": statistics.median(rates), "runs": rates})
    with open(path + ".out", "w") as out:
        json.dump({"levels": levels, "alone_token_ids": alone}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
