"""Runs vLLM offline over a prepared workload and prints one JSON line: the peer figure for
`minimill bench engine --peer vllm`.

Executed by path with the Python of a separate environment that has vLLM (never imported by
minimill, which does not depend on vLLM): `python vllm_runner.py SPEC.json`. The spec names an
HF model directory exported by minimill (same weights), the prompts as token ids, max_tokens,
dtype and the number of sequences per batch. Standard library and vLLM only.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", spec.get("cpu_bind", "0-1"))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec["kv_cache_gib"])  # as minimill's pool
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], gpu_memory_utilization=0.4,
              enable_prefix_caching=True, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in spec["max_tokens"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    import vllm

    print("PEER_RESULT " + json.dumps({
        "peer": "vllm", "version": vllm.__version__, "output_tokens": tokens,
        "seconds": round(seconds, 3), "output_tok_s": round(tokens / seconds, 2),
        "texts_sample": [o.outputs[0].text[:80] for o in outputs[:2]],
    }), flush=True)


if __name__ == "__main__":
    main()
