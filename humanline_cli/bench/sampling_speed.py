"""`humanline bench sampler=true`: tokens/s of transformers' generate vs the vLLM engine on the task's prompts (the
second call timed; vLLM's start-up reported apart)."""
from __future__ import annotations

import time

from humanline_cli.bench.clock import _now, load_model
from humanline_cli.errors import UserError


def sampler_bench(spec, info: dict, n_prompts: int) -> dict:
    from humanline_cli.core.interfaces import SamplingParams
    from humanline_cli.data.files import load_rows
    from humanline_cli.sampling.hf import HFSampler
    from humanline_cli.train.build import make_encoder, resolve_path

    backend = info["backend"]
    policy, model_path = load_model(spec, backend.device)
    encoder = make_encoder(spec, info["tokenizer"])
    p = spec.task_cfg.prompts
    rows, _ = load_rows(resolve_path(p.train, spec), p.train_split, n_prompts, p.columns)
    prompts = [encoder.prompt_ids(r["prompt"]) for r in rows]
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=spec.eval_cfg.max_new_tokens, seed=spec.seed)
    out: dict = {"prompts": len(prompts), "max_new_tokens": params.max_new_tokens}

    def timed(sampler) -> dict:
        sampler.generate(prompts, params)
        t0 = _now(backend.device)
        c = sampler.generate(prompts, params)
        dt = _now(backend.device) - t0
        return {"tokens": c.n_tokens, "seconds": dt, "tokens_per_s": c.n_tokens / dt}

    out["hf"] = timed(HFSampler(policy, info["tokenizer"], spec.sampler_cfg.batch_size, backend.autocast))
    try:
        from humanline_cli.sampling.vllm import VLLMSampler

        s = spec.sampler_cfg
        t0 = time.perf_counter()
        v = VLLMSampler(model_path, info["tokenizer"], seed=spec.seed, max_model_len=spec.train.max_length,
                        cpu_kvcache_gb=getattr(s, "cpu_kvcache_gb", 1))
        startup = time.perf_counter() - t0
        try:
            out["vllm"] = {**timed(v), "startup_s": startup}
        finally:
            v.close()
    except (UserError, ImportError) as e:
        out["vllm"] = {"error": str(e)}
    return out
