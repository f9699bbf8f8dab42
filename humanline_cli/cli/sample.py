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

DIR is new, empty, or one this command made (its sampling.json, written first, marks it); any other non-empty
dir is refused, so a stranger's groups.jsonl is never read or appended to. Every failure is one line: a bad
override, DIR unusable (a file, read-only), a full disk (the file named) exit 2; Ctrl-C exit 130 and SIGTERM
exit 143, each saying that a rerun resumes.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import sys
from pathlib import Path

from humanline_cli.errors import UserError, ignore_ctrl_c

OWN_KEYS = ("out", "chunk")
MARKER = "sampling.json"  # written first into DIR: the settings a resume must match, and proof DIR is ours


class Terminated(BaseException):
    """SIGTERM, raised where the main thread is (as Ctrl-C's KeyboardInterrupt is): a BaseException, so no
    `except Exception` on the way out swallows it."""


def _terminate(signum, frame):
    raise Terminated()


def _resume_note(out: Path | None) -> str:
    where = f" ({out / 'groups.jsonl'} keeps every prompt sampled so far)" if out is not None else ""
    return f"rerun the same command to resume{where}"


@contextlib.contextmanager
def _writing(path: Path, out: Path):
    """A failed write (a full disk, a read-only mount) as one line naming the file."""
    try:
        yield
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}; free the space (or fix the mount) and "
                        f"{_resume_note(out)}") from None


def prepare_out(out: Path) -> None:
    """DIR made, or checked to be ours (MARKER) or empty, before any work."""
    if out.exists() and not out.is_dir():
        raise UserError(f"out={out} is a file, not a directory; use another out=DIR")
    if out.is_dir() and not (out / MARKER).is_file() and any(out.iterdir()):
        raise UserError(f"out={out} is not empty and was not made by humanline sample (no {MARKER}); use a new or "
                        f"empty out=DIR")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create out={out}: {e.strerror or e}") from None


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

    from humanline_cli.config import resolve

    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = compose("train", overrides=["data=online", *overrides])
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(f"bad override: {str(e).splitlines()[0]}") from None
    return resolve(cfg)


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
    """JSON lines, whole or not at all: a temp file renamed over `path` (removed if the write fails)."""
    _write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def labeller_text(spec) -> str:
    """Who scored the samples. A bundled world's scorer says its role too: the judge and the proxy labeller of
    one world score the same completions differently, and a set must say which it holds."""
    if spec.reward_cfg.kind != "task":
        return f"reward={spec.reward_cfg.kind}"
    lab = spec.task_cfg.labeller
    kind = getattr(lab.kind, "value", lab.kind)
    world = f" {lab.task}/{lab.role}" if kind == "world" and lab.task and lab.role else ""
    return f"task.labeller: {kind}" + (f" {lab.name_or_path}" if lab.name_or_path else "") + world


def card(spec, model_path: str, groups: list[dict], settings: dict) -> dict:
    scores = [s for g in groups for s in g["rewards"]]

    def text(c) -> str:
        return c if isinstance(c, str) else c[0]["content"]

    return {
        "model": spec.model_cfg.name_or_path, "model_path": model_path,
        "labeller": labeller_text(spec),
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
    from humanline_cli.backend import make_backend, seed_everything
    from humanline_cli.data.files import load_rows
    from humanline_cli.models import load_policy, load_tokenizer
    from humanline_cli.train.build import (
        make_encoder,
        make_labeller,
        model_paths,
        prepare_model,
        prepare_world,
        resolve_path,
        resolve_precision,
    )
    from humanline_cli.train.samplers import make_sampler, sampling_params

    prepare_out(out)  # before any work: a stranger's dir is refused untouched
    b = spec.backend_cfg
    backend = make_backend(b.device.value, b.precision.value, spec.threads)
    seed_everything(spec.seed)
    prepare_world(spec, progress=progress)
    prepare_model(spec, progress=progress)
    spec, backend = resolve_precision(spec, backend, str(backend.device), "single")  # auto on CPU: measured
    d, p = spec.data_cfg, spec.task_cfg.prompts
    rows, where = load_rows(resolve_path(d.prompts, spec), p.train_split, d.limit, p.columns, limit_key="data.limit")
    model_path, tok_path = model_paths(spec)
    tokenizer = load_tokenizer(tok_path, spec.model_cfg.trust_remote_code)
    encoder = make_encoder(spec, tokenizer)
    encoder.check_prompts(rows, where)
    params = sampling_params(spec)
    settings = {"sampler": spec.sampler_cfg.name, "n": d.n, "temperature": d.temperature, "top_p": d.top_p,
                "max_new_tokens": d.max_new_tokens, "seed": spec.seed}
    groups_path = out / "groups.jsonl"
    _claim(out, {**settings, "model": model_path, "prompts": len(rows)})
    with _writing(groups_path, out):
        done = _complete_lines(groups_path)
    if done < len(rows):
        policy = load_policy(model_path, backend.device, spec.model_cfg.trust_remote_code, dtype=backend.weights_dtype)
        policy.eval()
        sampler = make_sampler(spec, policy, tokenizer, backend, model_path, call_sequences=chunk * d.n)
        labeller = make_labeller(spec, backend.device)
        try:
            _sample_groups(sampler, labeller, encoder, rows, params, groups_path, done, chunk, progress)
        finally:
            sampler.close()
    groups = [json.loads(x) for x in groups_path.read_text(encoding="utf-8").splitlines()]
    info = card(spec, model_path, groups, settings)
    _write_derived(out, groups, info)
    return info


def _claim(out: Path, state: dict) -> None:
    """Record the sampling settings in out/ (first run), or check that a rerun resumes with the same ones."""
    state_path = out / MARKER
    if state_path.is_file():
        try:
            saved = json.loads(state_path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read {state_path}: {getattr(e, 'strerror', None) or e}; use another "
                            f"out=DIR") from None
        if saved != state:
            raise UserError(f"{out} holds samples made with other settings ({state_path}); use another out=DIR")
    else:
        with _writing(state_path, out):
            _write(state_path, [state])


def _sample_groups(sampler, labeller, encoder, rows: list[dict], params, groups_path: Path, done: int, chunk: int,
                   progress: bool) -> None:
    """Sample and score rows[done:] `chunk` prompts at a time, appending one line per prompt to groups.jsonl."""
    from tqdm import tqdm

    from humanline_cli.rewards.scorers import checked

    out, (name, label), n = groups_path.parent, labeller, params.n
    bar = tqdm(total=len(rows), initial=done, desc="sample", unit="prompt", disable=not progress, file=sys.stderr)
    try:
        for start in range(done, len(rows), chunk):
            idx = list(range(start, min(start + chunk, len(rows))))
            prompts = [rows[i]["prompt"] for i in idx]
            got = sampler.generate([encoder.prompt_ids(q) for q in prompts], params, indices=idx)
            texts = [encoder.prompt_text(q) for q in prompts for _ in range(n)]
            answers = [rows[i].get("answer") for i in idx for _ in range(n)] if "answer" in rows[0] else None
            scores = checked(name, label, texts, got.texts, answers)
            lines = "".join(json.dumps({"prompt": q,
                                        "completions": [_reply(q, t) for t in got.texts[a * n:(a + 1) * n]],
                                        "rewards": scores[a * n:(a + 1) * n]}, ensure_ascii=False) + "\n"
                            for a, q in enumerate(prompts))
            with _writing(groups_path, out), open(groups_path, "a", encoding="utf-8") as f:
                f.write(lines)  # a chunk cut short (a full disk, a kill) leaves half a line: a rerun drops it
            bar.update(len(idx))
    finally:
        bar.close()


def _write_derived(out: Path, groups: list[dict], info: dict) -> None:
    """pairs.jsonl and unpaired.jsonl from the groups, and the card."""
    derived = [derived_rows(g) for g in groups]
    with _writing(out / "pairs.jsonl", out):
        _write(out / "pairs.jsonl", (pair for pair, _ in derived))
    with _writing(out / "unpaired.jsonl", out):
        _write(out / "unpaired.jsonl", (u for _, rows_ in derived for u in rows_))
    with _writing(out / "card.json", out):
        _write_text(out / "card.json", json.dumps(info, indent=2) + "\n")


def main_sample(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    own, overrides = _split_args(args)
    out = Path(own["out"]) if own.get("out") else None
    old = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _main(own, overrides)
    except UserError as e:
        print(f"humanline: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # anything else the file system refuses (a write is named by _writing)
        print(f"humanline: error: {e.filename or 'humanline sample'}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        ignore_ctrl_c()  # a second Ctrl-C must not cut this line short
        print(f"humanline: sample interrupted (Ctrl-C); {_resume_note(out)}", file=sys.stderr)
        return 130
    except Terminated:
        print(f"humanline: sample stopped by SIGTERM; {_resume_note(out)}", file=sys.stderr)
        return 143
    finally:
        signal.signal(signal.SIGTERM, old)


def _main(own: dict, overrides: list[str]) -> int:
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
