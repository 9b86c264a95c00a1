"""transformers' own `generate` behind SpecGenerator's interface: the decoder a user would run
instead of ours, as a row of `d3d.eval` (`eval.reference_generate=true`, method name `generate`),
timed in the same process, on the same prompts and in the same dtype as every other method.

Timing: `generate` does not report its prefill apart, so the prompt's forward pass is timed on its
own first (one extra pass, outside the timed call) and decode time = the call's wall time minus
it. The prefill pass yields generate's first token, so its decode time covers N-1 steps for N new
tokens: the per-token time favours the baseline slightly, never the speculative methods.
"""

from __future__ import annotations

import time

import torch

from d3d.decoding.engine import GenerationResult, context_problem
from d3d.decoding.config import DecodeConfig
from d3d.decoding.passes import RoundStats, _sync


class HFGenerate:
    """`HFGenerate(target, tokenizer, DecodeConfig(method="ar", ...), eos).generate([prompt_ids])`:
    batch 1, greedy (or sampled with the run's temperature / top-p / top-k)."""

    def __init__(self, target, tokenizer, cfg: DecodeConfig, eos_token_ids: list[int]):
        self.target, self.tokenizer, self.cfg, self.eos = target, tokenizer, cfg, list(eos_token_ids)
        self.device = next(target.parameters()).device
        self.seed = 0

    def context_problem(self, prompts: list[list[int]], max_new_tokens: int) -> str | None:
        return context_problem(self.target, prompts, max_new_tokens)

    @torch.inference_mode()
    def _prefill_s(self, ids: torch.Tensor) -> float:
        _sync(self.device)
        start = time.perf_counter()
        self.target(input_ids=ids, use_cache=True, logits_to_keep=1)
        _sync(self.device)
        return time.perf_counter() - start

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | None = None,
                 seed: int | None = None) -> GenerationResult:
        if len(prompts) != 1:
            raise ValueError("the generate reference decodes one request at a time (eval.concurrency=[1])")
        s, max_new = self.cfg.sampling, int(max_new_tokens or self.cfg.max_new_tokens)
        ids = torch.tensor(prompts, device=self.device)
        prefill = self._prefill_s(ids)
        kwargs = {"do_sample": False} if s.greedy else {"do_sample": True, "temperature": s.temperature,
                                                          "top_p": s.top_p, "top_k": s.top_k or None}
        if not s.greedy:
            torch.manual_seed(int(self.seed if seed is None else seed))
        if self.cfg.stop_strings:  # generate stops after the token that completes one, as our loop does
            kwargs.update(stop_strings=list(self.cfg.stop_strings), tokenizer=self.tokenizer)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]
        _sync(self.device)
        start = time.perf_counter()
        out = self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                   eos_token_id=self.eos, pad_token_id=pad, **kwargs)
        _sync(self.device)
        wall = time.perf_counter() - start
        new = out[0, ids.shape[1]:].tolist()
        finish = "stop" if len(new) < max_new else "length"
        for i, t in enumerate(new):
            if t in self.eos:  # generate pads after EOS: cut there, EOS kept as our loop keeps it
                new, finish = new[: i + 1], "stop"
                break
        rounds = [RoundStats([0], [1]) for _ in new]  # one token per step
        return GenerationResult([new], [self.tokenizer.decode(new, skip_special_tokens=True)], [finish], rounds,
                                prefill_s=prefill, decode_s=max(wall - prefill, 1e-9))
