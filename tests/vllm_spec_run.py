"""Run vLLM greedy on token-id prompts, with or without a speculative_config, in vLLM's own
environment (.venv-vllm: it pins its own torch), and write what it made as JSON:
`python tests/vllm_spec_run.py <in.json> <out.json>`, in = {"target", "prompts" (token ids),
"max_tokens", "dtype", "speculative_config" (or null)}; out = {"outputs" (token ids per prompt),
"metrics" (the spec-decode counters, summed)}. Used by tests/integration/test_serving.py and
scripts/served_tau.py; of d3d it imports only the counter reader d3d.bench_engines.counters (no torch, no
model: the engine's process stays the engine's), the one d3d.bench's engine rows use."""

from __future__ import annotations

import json
import sys

from d3d.bench_engines import counters


def main(inp: str, outp: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(open(inp).read())
    llm = LLM(model=job["target"], dtype=job["dtype"], enforce_eager=True, disable_log_stats=False, seed=0,
              max_model_len=job.get("max_model_len", 1024), speculative_config=job["speculative_config"])
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=job.get("ignore_eos", False))
    done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    result = {"outputs": [list(r.outputs[0].token_ids) for r in done], "metrics": counters(llm)}
    with open(outp, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(*sys.argv[1:3])
