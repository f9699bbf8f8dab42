"""Builds one world into an (empty, temporary) folder.

Consumes a resolved cfg (see `defaults.resolve`); produces every entry of
`WORLD_FILES` in the folder: `policy/` (safetensors weights + tokenizer),
the offline JSONL files, the train/eval prompt lists and `world.json`
(written last: cfg, version, build seconds and base-policy metrics measured
on the eval prompts). Seeded throughout, with one RNG stream per stage, so
the offline data does not depend on SFT.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
import transformers

from ..sampling.base import SamplingParams
from ..sampling.hf import HFSampler
from . import arithmetic, offline, policy, preference, rewards
from .tokenizer import build_tokenizer

# SFT loss that means "stuck": arithmetic's ones digit (a mod-10 lookup) can sit
# on a ~0.8-nat plateau for a seed-dependent number of steps (the noisy
# teacher's floor is ~0.3). A stuck run gets up to two extra rounds of SFT.
STUCK_LOSS = {"arithmetic": 0.6}
RESCUE_ROUNDS = 2

# Longest reply + EOS, with slack so a rambling policy is still cut short.
MAX_NEW = {"arithmetic": 5, "preference": 16}


def _prompts(cfg: dict, rng: random.Random):
    """(train, eval, sft_draw, teacher) for the task."""
    kind, clean = cfg["kind"], cfg["sft"]["teacher"] == "clean"
    if kind == "arithmetic":
        train, eval_, pool = arithmetic.split_prompts(rng, cfg["n_train_prompts"], cfg["n_eval_prompts"])
        teacher = (lambda r, p: arithmetic.answer(p)) if clean else arithmetic.teacher
        return train, eval_, (lambda r: r.choice(pool)), teacher
    train, eval_, banned = preference.split_prompts(rng, cfg["n_train_prompts"], cfg["n_eval_prompts"])

    def draw(r: random.Random) -> str:  # fresh prompts, never an eval letter set
        while True:
            p = preference.random_prompt(r)
            if "".join(sorted(p)) not in banned:
                return p

    teacher = (lambda r, p: preference.ideal(p)) if clean else preference.teacher
    return train, eval_, draw, teacher


def _tail(losses: list[float], n: int = 50) -> float:
    tail = losses[-n:]
    return sum(tail) / max(1, len(tail))


def measure(kind: str, model, tok, prompts: list[str], seed: int) -> dict:
    """Base-policy metrics on the eval prompts: greedy and T=1 sampled."""
    enc = policy.WorldCodec(tok)
    sampler = HFSampler(model, tok, batch_size=len(prompts))  # the project's own sampler, as in eval
    prompt_ids = [enc.prompt(p) for p in prompts]
    out: dict = {"n_eval": len(prompts)}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        params = SamplingParams(n=1, temperature=temperature, max_new_tokens=MAX_NEW[kind], seed=seed)
        completions = sampler.generate(prompt_ids, params)
        ids, texts = completions.token_ids, completions.texts
        out[f"{name}_eos_rate"] = sum(bool(i) and i[-1] == tok.eos_token_id for i in ids) / len(ids)
        judged = rewards.score(kind, "judge", prompts, texts)
        if kind == "arithmetic":
            out[f"{name}_accuracy"] = sum(judged) / len(judged)
            carry = [s for p, s in zip(prompts, judged) if int(p[1]) + int(p[4]) >= 10]
            out[f"{name}_accuracy_carry"] = sum(carry) / max(1, len(carry))
        else:
            out[f"{name}_judge"] = sum(judged) / len(judged)
            lab = rewards.score(kind, "labeller", prompts, texts)
            out[f"{name}_labeller"] = sum(lab) / len(lab)
            out[f"{name}_exact"] = sum(t == preference.ideal(p) for p, t in zip(prompts, texts)) / len(texts)
    return out


def build(cfg: dict, out_dir: Path, version: int, progress: bool) -> dict:
    start = time.perf_counter()
    seed = int(cfg["seed"])
    train, eval_, draw, teacher = _prompts(cfg, random.Random(f"{seed}:prompts"))

    tok = build_tokenizer()
    model = policy.new_model(cfg["model"], tok, seed)
    enc, sft_rng = policy.WorldCodec(tok), random.Random(f"{seed}:sft")
    losses = policy.sft(model, enc, cfg["sft"], draw, teacher, sft_rng, progress)
    rescues = 0
    while rescues < RESCUE_ROUNDS and _tail(losses) > STUCK_LOSS.get(cfg["kind"], float("inf")):
        rescues += 1  # deterministic: same seed, same decision
        more = dict(cfg["sft"], steps=max(1, cfg["sft"]["steps"] // 2), warmup=0)
        losses += policy.sft(model, enc, more, draw, teacher, sft_rng, progress)
    model.save_pretrained(out_dir / "policy", safe_serialization=True)
    tok.save_pretrained(out_dir / "policy")

    for name, rows in offline.records(
        cfg["kind"], cfg["offline"], train, random.Random(f"{seed}:offline")
    ).items():
        offline.write_jsonl(out_dir / name, rows)
    offline.write_jsonl(out_dir / "prompts_train.jsonl", offline.prompt_rows(train))
    offline.write_jsonl(out_dir / "prompts_eval.jsonl", offline.prompt_rows(eval_))

    metrics = measure(cfg["kind"], model, tok, eval_, seed)
    info = {
        "kind": cfg["kind"],
        "version": version,
        "cfg": cfg,
        "build_seconds": round(time.perf_counter() - start, 2),
        "torch_threads": torch.get_num_threads(),
        "sft_final_loss": _tail(losses),
        "sft_steps_run": len(losses),
        "sft_rescue_rounds": rescues,
        "n_parameters": sum(p.numel() for p in model.parameters()),
        "base_metrics": metrics,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (out_dir / "world.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
