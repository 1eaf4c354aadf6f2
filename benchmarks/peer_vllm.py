"""The vLLM side of `pdserve bench engine --peer vllm`: a standalone script that the
benchmark runs with the peer's own interpreter (`.venv-peers/vllm/bin/python`, made by
`make bench-peers`).

    python benchmarks/peer_vllm.py JOB.json|- RESULT.json

It imports vLLM and the standard library only: the peer's environment has no pdserve
package (import-linter keeps it so). The job (`benchmarks.peer.build_job`) names the model
directory, dtype, context length, a warm-up and the workloads, each as prompts of token ids
and one output length per prompt. The result records how long `vllm.LLM(...)` took to
start, and each workload's wall time and generated token ids, in the job's order.

Every request is greedy (temperature 0), ignores EOS and generates exactly its own
`max_tokens`, as pdserve's requests do; prefix caching is off, so a prompt seen in the
warm-up or an earlier workload costs its full prefill. The CPU placement, the KV cache
size and the OpenMP runtime come from the environment the benchmark sets
(VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE, LD_PRELOAD; `benchmarks.peer.peer_env`).
"""

from __future__ import annotations

import json
import sys
import time


def run(job: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], enable_prefix_caching=False,
              max_model_len=job["max_model_len"], seed=job.get("seed", 0))
    startup_s = time.perf_counter() - start

    def generate(workload: dict) -> tuple[float, list[list[int]]]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for n in workload["output_lens"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, [list(o.outputs[0].token_ids) for o in outputs]

    # One-time costs (first batch shapes, kernel selection) stay out of the measurement.
    generate(job["warmup"])
    workloads = []
    for w in job["workloads"]:
        seconds, token_ids = generate(w)
        print(f"peer_vllm: {w['name']}: {sum(w['output_lens'])} tokens in {seconds:.2f} s",
              file=sys.stderr, flush=True)
        workloads.append({"name": w["name"], "seconds": seconds, "token_ids": token_ids})
    return {"peer": "vllm", "version": vllm.__version__, "startup_s": startup_s,
            "workloads": workloads}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python peer_vllm.py JOB.json|- RESULT.json", file=sys.stderr)
        return 2
    job_path, result_path = argv
    job = json.load(sys.stdin) if job_path == "-" else json.loads(open(job_path).read())
    result = run(job)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
