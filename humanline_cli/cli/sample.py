"""`humanline sample out=DIR [overrides]`: an offline dataset sampled from a model with the online rounds'
sampler and labeller (the paper's instruction-following regime: the starting policy's own samples, scored,
best vs worst).

The overrides are `humanline train`'s (task=, model=, sampler=, reward=, seed=, data.n=, data.temperature=,
data.top_p=, data.max_new_tokens=, data.limit=, ...), composed with data=online: the prompts are the task's
training prompts (data.prompts), the model is model.name_or_path (default: the run's starting policy), N =
data.n samples per prompt. Writes into DIR:
  groups.jsonl     {prompt, completions, rewards}: every sample of a prompt with its score (GRPO)
  pairs.jsonl      {prompt, chosen, rejected, score_chosen, score_rejected}: best vs worst (DPO; ties written,
                   `data.min_gap` drops them at training time)
  unpaired.jsonl   {prompt, completion, label}: every sample, desirable iff its score is above its prompt's mean
                   (all tied: iff score >= 0.5) (KTO)
  card.json        model, labeller, sampling settings, counts and score statistics
Completions are strings for string prompts and assistant messages for chat prompts (TRL's standard and
conversational formats), so `data.path=DIR/pairs.jsonl` trains on them directly.

Deterministic: completion j of prompt i draws from sample_seed(seed, i, j) (sampling.sampler), whatever the
chunking. Resumable: groups.jsonl is appended chunk by chunk (`chunk=` prompts, default 64) and flushed; a rerun
of the same command keeps its complete lines (a half-written last line is dropped) and samples the rest; the
derived files and the card are written at the end, each through a temporary file and a rename.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from humanline_cli.errors import UserError

OWN_KEYS = ("out", "chunk")


def _split_args(args: list[str]) -> tuple[dict, list[str]]:
    own, rest = {}, []
    for a in args:
        key, sep, value = a.partition("=")
        if sep and key in OWN_KEYS:
            own[key] = value
        else:
            rest.append(a)
    return own, rest


def _spec(overrides: list[str]):
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from humanline_cli.config import validate

    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = compose("train", overrides=["data=online", *overrides])
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(f"bad override: {str(e).splitlines()[0]}") from None
    return validate(cfg)


def _complete_lines(path: Path) -> int:
    """Complete JSON lines at the start of `path`; the file is cut back to them (a crash mid-write)."""
    if not path.is_file():
        return 0
    keep, n = 0, 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                json.loads(line)
            except ValueError:
                break
            keep += len(line)
            n += 1
    with open(path, "r+b") as f:
        f.truncate(keep)
    return n


def _reply(prompt, text: str):
    """A completion in the prompt's format: a string, or one assistant message for chat prompts."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


def derived_rows(group: dict) -> tuple[dict, list[dict]]:
    """One prompt's (pair, unpaired rows) from its group: best vs worst (the first best, the first worst other
    than it), and every sample labelled against the prompt's mean score."""
    prompt, comps, scores = group["prompt"], group["completions"], group["rewards"]
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    worst = min(range(len(scores)), key=lambda i: (scores[i], i == best, i))
    pair = {"prompt": prompt, "chosen": comps[best], "rejected": comps[worst], "score_chosen": scores[best],
            "score_rejected": scores[worst]}
    mean, tied = sum(scores) / len(scores), len(set(scores)) == 1
    unpaired = [{"prompt": prompt, "completion": c, "label": bool(s >= 0.5 if tied else s > mean)}
                for c, s in zip(comps, scores)]
    return pair, unpaired


def _write(path: Path, rows) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    os.replace(tmp, path)


def card(spec, model_path: str, groups: list[dict], settings: dict) -> dict:
    scores = [s for g in groups for s in g["rewards"]]

    def text(c) -> str:
        return c if isinstance(c, str) else c[0]["content"]

    return {
        "model": spec.model_cfg.name_or_path, "model_path": model_path,
        "labeller": (f"reward={spec.reward_cfg.kind}" if spec.reward_cfg.kind != "task" else
                     f"task.labeller: {spec.task_cfg.labeller.kind}"
                     + (f" {spec.task_cfg.labeller.name_or_path}" if spec.task_cfg.labeller.name_or_path else "")),
        "task": spec.task, "prompts": spec.data_cfg.prompts, "sampling": settings,
        "counts": {"prompts": len(groups), "samples": len(scores),
                   "pairs_strict": sum(max(g["rewards"]) > min(g["rewards"]) for g in groups),
                   "groups_tied": sum(len(set(g["rewards"])) == 1 for g in groups),
                   "empty_completions": sum(1 for g in groups for c in g["completions"] if not text(c).strip())},
        "scores": {"mean": statistics.fmean(scores) if scores else None,
                   "std": statistics.pstdev(scores) if scores else None,
                   "min": min(scores, default=None), "max": max(scores, default=None),
                   "best_mean": statistics.fmean(max(g["rewards"]) for g in groups) if groups else None,
                   "worst_mean": statistics.fmean(min(g["rewards"]) for g in groups) if groups else None},
    }


def run_sample(spec, out: Path, chunk: int, progress: bool = True) -> dict:
    """Sample spec.data_cfg.n completions per prompt into out/ (see the module docstring); returns the card."""
    from tqdm import tqdm

    from humanline_cli.backend import make_backend, seed_everything
    from humanline_cli.data.files import load_rows
    from humanline_cli.models import load_policy, load_tokenizer
    from humanline_cli.rewards.scorers import checked
    from humanline_cli.sampling.sampler import SamplingParams
    from humanline_cli.train.build import (
        make_encoder,
        make_labeller,
        make_sampler,
        model_paths,
        prepare_model,
        prepare_world,
        resolve_path,
    )

    b = spec.backend_cfg
    backend = make_backend(b.device.value, b.precision.value, spec.threads)
    seed_everything(spec.seed)
    prepare_world(spec, progress=progress)
    prepare_model(spec, progress=progress)
    d, p = spec.data_cfg, spec.task_cfg.prompts
    rows, where = load_rows(resolve_path(d.prompts, spec), p.train_split, d.limit, p.columns, limit_key="data.limit")
    model_path, tok_path = model_paths(spec)
    tokenizer = load_tokenizer(tok_path, spec.model_cfg.trust_remote_code)
    encoder = make_encoder(spec, tokenizer)
    encoder.check_prompts(rows, where)
    params = SamplingParams(n=d.n, temperature=d.temperature, top_p=d.top_p, max_new_tokens=d.max_new_tokens,
                            seed=spec.seed)
    settings = {"sampler": spec.sampler_cfg.name, "n": d.n, "temperature": d.temperature, "top_p": d.top_p,
                "max_new_tokens": d.max_new_tokens, "seed": spec.seed}
    out.mkdir(parents=True, exist_ok=True)
    groups_path, state_path = out / "groups.jsonl", out / "sampling.json"
    if state_path.is_file() and json.loads(state_path.read_text()) != {**settings, "model": model_path,
                                                                        "prompts": len(rows)}:
        raise UserError(f"{out} holds samples made with other settings ({state_path}); use another out=DIR")
    state_path.write_text(json.dumps({**settings, "model": model_path, "prompts": len(rows)}) + "\n")
    done = _complete_lines(groups_path)
    if done < len(rows):
        policy = load_policy(model_path, backend.device, spec.model_cfg.trust_remote_code, dtype=backend.weights_dtype)
        policy.eval()
        sampler = make_sampler(spec, policy, tokenizer, backend, model_path)
        name, labeller = make_labeller(spec, backend.device)
        n, bar = d.n, tqdm(total=len(rows), initial=done, desc="sample", unit="prompt", disable=not progress,
                           file=sys.stderr)
        try:
            with open(groups_path, "a", encoding="utf-8") as f:
                for start in range(done, len(rows), chunk):
                    idx = list(range(start, min(start + chunk, len(rows))))
                    prompts = [rows[i]["prompt"] for i in idx]
                    got = sampler.generate([encoder.prompt_ids(q) for q in prompts], params, indices=idx)
                    texts = [encoder.prompt_text(q) for q in prompts for _ in range(n)]
                    answers = [rows[i].get("answer") for i in idx for _ in range(n)] if "answer" in rows[0] else None
                    scores = checked(name, labeller, texts, got.texts, answers)
                    for a, q in enumerate(prompts):
                        f.write(json.dumps({"prompt": q,
                                            "completions": [_reply(q, t) for t in got.texts[a * n:(a + 1) * n]],
                                            "rewards": scores[a * n:(a + 1) * n]}, ensure_ascii=False) + "\n")
                    f.flush()
                    bar.update(len(idx))
        finally:
            bar.close()
            sampler.close()
    groups = [json.loads(x) for x in groups_path.read_text(encoding="utf-8").splitlines()]
    derived = [derived_rows(g) for g in groups]
    _write(out / "pairs.jsonl", (pair for pair, _ in derived))
    _write(out / "unpaired.jsonl", (u for _, rows_ in derived for u in rows_))
    info = card(spec, model_path, groups, settings)
    (out / "card.json.tmp").write_text(json.dumps(info, indent=2) + "\n")
    os.replace(out / "card.json.tmp", out / "card.json")
    return info


def main_sample(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        return _main(args)
    except UserError as e:
        print(f"humanline: error: {e}", file=sys.stderr)
        return 2


def _main(args: list[str]) -> int:
    own, overrides = _split_args(args)
    if not own.get("out"):
        raise UserError("humanline sample needs out=DIR (where groups.jsonl, pairs.jsonl, unpaired.jsonl and "
                        "card.json go)")
    try:
        chunk = int(own.get("chunk", 64))
    except ValueError:
        raise UserError(f"chunk must be a positive integer, got {own['chunk']!r}") from None
    if chunk < 1:
        raise UserError(f"chunk must be a positive integer, got {chunk}")
    info = run_sample(_spec(overrides), Path(own["out"]), chunk)
    c, s = info["counts"], info["scores"]
    print(f"humanline sample: {c['prompts']} prompts x {info['sampling']['n']} samples from {info['model']} -> "
          f"{own['out']} (score mean {s['mean']:.3f}, best {s['best_mean']:.3f}, worst {s['worst_mean']:.3f}; "
          f"{c['pairs_strict']} strict pairs, {c['groups_tied']} tied groups)")
    return 0
