"""`humanline eval RUN_DIR [--against RUN_DIR|start|FILE]`: pairwise win rate of one trained policy
against another run's policy, the starting policy or a file of reference outputs (AlpacaEval's
format), under the run's task judge, on the task's held-out prompts, with a 95% CI. Writes
eval_vs_<name>.json into RUN_DIR. With eval.math500.prompts set (in the run or as an override), also the
benchmark accuracy of the run's policy: eval_math500.json, and `eval.math500` in the run's summary.json."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from humanline_cli.errors import ArgumentParser, UserError, ignore_ctrl_c

# what a later evaluation may choose: the judge (judge=..., or the task's own: task.judge.*), the held-out
# prompts (task.prompts.eval, its split and column renames) and the sampling (eval.*); never what was trained
EVAL_KEYS = ("judge", "eval.", "task.judge.", "task.prompts.", "task.verifiable")


def _run_spec(run_dir: Path, overrides: list[str] | None = None):
    """The run's saved config, re-validated, with `judge=NAME` / `judge.KEY=V` / `eval.KEY=V` applied."""
    from importlib.resources import files

    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from humanline_cli.config import resolve

    path = run_dir / ".hydra" / "config.yaml"
    if not path.exists():
        raise UserError(f"{run_dir} is not a run dir (no .hydra/config.yaml)")
    if not (run_dir / "model" / "config.json").exists():
        raise UserError(f"{run_dir} has no saved model (model/); was it trained with train.save_model=true?")
    cfg = OmegaConf.load(path)
    dotlist = []
    for o in overrides or []:
        key, sep, value = o.partition("=")
        if not sep or not key.startswith(EVAL_KEYS):
            raise UserError(f"humanline eval takes judge=NAME, judge.KEY=VALUE, task.judge.KEY=VALUE, "
                            f"task.prompts.KEY=VALUE, task.verifiable=BOOL and eval.KEY=VALUE overrides; got {o!r}")
        if key == "judge":
            option = files("conf").joinpath("judge", f"{value}.yaml")
            if not option.is_file():
                names = sorted(q.name[:-5] for q in files("conf").joinpath("judge").iterdir() if q.name.endswith(".yaml"))
                raise UserError(f"unknown judge {value!r} (choose from: {', '.join(names)})")
            node = OmegaConf.create(option.read_text())
            node.pop("defaults", None)
            cfg.judge = node
        else:
            dotlist.append(o)
    try:
        cfg.merge_with(OmegaConf.from_dotlist(dotlist))
    except OmegaConfBaseException as e:
        raise UserError(f"bad override: {str(e).splitlines()[0]}") from None
    return resolve(cfg)


def evaluate_pair(run_dir: Path, against: str, n_prompts: int | None, temperature: float | None,
                  seed: int, overrides: list[str] | None = None) -> dict:
    """Rebuilds the run's evaluator with the same builder `humanline train` used (its eval split,
    column names, chat-template wrapping and judge), so both evaluate identical prompts."""
    from humanline_cli.backend import make_backend, seed_everything
    from humanline_cli.models import load_policy, load_tokenizer
    from humanline_cli.sampling.hf import HFSampler
    from humanline_cli.train.build import (
        build_evaluator,
        build_math500,
        make_encoder,
        prepare_model,
        prepare_world,
        resolve_precision,
    )
    from humanline_cli.train.lengths import check_model_lengths

    spec = _run_spec(run_dir, overrides)
    ev = spec.eval_cfg
    changes = {k: v for k, v in (("n_prompts", n_prompts), ("temperature", temperature)) if v is not None}
    if changes:
        spec = replace(spec, eval_cfg=replace(ev, **changes))
    check_model_lengths(spec, str(run_dir / "model"))  # evaluation budgets against the model's positions
    if against == "start":
        prepare_world(spec)  # the bundled world, built first if it is not cached (its paths resolve after)
        prepare_model(spec)  # a packaged model (model=smollm2), converted first if it is not cached
    b = spec.backend_cfg
    backend = make_backend(b.device.value, b.precision.value, spec.threads)
    # auto on CPU: as the run chose (the cached probe at the trained model's shapes)
    spec, backend = resolve_precision(spec, backend, str(backend.device), "single", str(run_dir / "model"))
    seed_everything(seed)
    trust = spec.model_cfg.trust_remote_code
    tok = load_tokenizer(str(run_dir / "model"), trust)
    encoder = make_encoder(spec, tok)
    math500 = build_math500(spec, encoder, seed)  # eval.math500.prompts set: benchmark accuracy too
    if spec.judge_cfg.kind == "none" and math500 is None:
        raise UserError("judge=none: nothing to evaluate with (choose judge=task or judge=llm, or set "
                        "eval.math500.prompts=FILE)")
    evaluator = build_evaluator(spec, encoder, backend.device, seed) if spec.judge_cfg.kind != "none" else None
    if evaluator is None and math500 is None:  # judge=task, and the run was trained without one
        raise UserError(f"{run_dir} was trained without a judge (task.judge.kind=none): name one, e.g. "
                        f"task.judge.kind=model task.judge.name_or_path=DIR, task.judge.kind=verifier, or judge=llm "
                        f"(and task.prompts.eval=FILE if the run had no eval prompts)")
    batch = spec.eval_cfg.batch_size
    result = {"run": str(run_dir), "seed": seed}
    if evaluator is not None:
        result.update(_pairwise(spec, run_dir, against, evaluator, backend, tok, seed))
    if math500 is not None:
        policy = load_policy(str(run_dir / "model"), backend.device, trust).eval()
        m = math500.evaluate(HFSampler(policy, tok, batch, backend.autocast), run_dir / "eval_math500_samples.jsonl")
        del policy
        _save_math500(run_dir, m, seed)
        result["math500"] = m
    return result


def _pairwise(spec, run_dir: Path, against: str, evaluator, backend, tok, seed: int) -> dict:
    """The trained policy against another run's, the start or a file of reference outputs: eval_vs_<name>.json."""
    from humanline_cli.models import load_policy
    from humanline_cli.sampling.hf import HFSampler
    from humanline_cli.train.build import model_paths

    trust = spec.model_cfg.trust_remote_code
    batch = spec.eval_cfg.batch_size
    against_file = against != "start" and Path(against).is_file()  # reference outputs (AlpacaEval's format)
    if against == "start":
        other_path, other_name = model_paths(spec)[0], "start"
    elif against_file:
        other_path, other_name = None, Path(against).stem
    else:
        other_dir = Path(against)
        _run_spec(other_dir)
        other_path, other_name = str(other_dir / "model"), other_dir.name
    if against_file:
        from humanline_cli.rewards.alpaca import read_reference_outputs

        evaluator.set_baseline_texts(read_reference_outputs(against, evaluator.prompt_text))
    else:
        other = load_policy(other_path, backend.device, trust).eval()
        evaluator.set_baseline(HFSampler(other, tok, batch, backend.autocast))
        del other
    policy = load_policy(str(run_dir / "model"), backend.device, trust).eval()
    result = evaluator.evaluate(HFSampler(policy, tok, batch, backend.autocast),
                                run_dir / f"eval_vs_{other_name}_samples.jsonl")
    result = {"run": str(run_dir), "against": other_name, "seed": seed, **result}
    (run_dir / f"eval_vs_{other_name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _save_math500(run_dir: Path, m: dict, seed: int) -> None:
    """eval_math500.json, and the run's summary.json `eval.math500` (where `humanline report` reads it), each
    written whole (a temp file renamed over the old one)."""
    from humanline_cli.atomic import write_json_atomic

    write_json_atomic(run_dir / "eval_math500.json", {"run": str(run_dir), "seed": seed, "math500": m})
    path = run_dir / "summary.json"
    if path.is_file():
        summary = json.loads(path.read_text())
        summary["eval"] = {**(summary.get("eval") or {}), "math500": {**m, "by": "humanline eval", "seed": seed}}
        write_json_atomic(path, summary)


def _masked(message: str, overrides: list[str]) -> str:
    """`message` with the value of every secret-named override (`+judge.api_key=...`) masked, as the saved
    config masks it: an error line may quote an override whole or echo its value."""
    from humanline_cli.train.tracking import MASK, is_secret_key

    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and value and is_secret_key(key.lstrip("+~")):
            message = message.replace(value, MASK)
    return message


def main_eval(argv: list[str]) -> int:
    p = ArgumentParser(prog="humanline eval", description=__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--against", default="start", help="another run dir, 'start' (default), or a file of reference "
                   "outputs in AlpacaEval's format ({instruction, output} per eval prompt, .json or .jsonl)")
    p.add_argument("--n-prompts", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="judge=llm|task, judge.KEY=VALUE (e.g. judge.model=gpt-4.1, "
                   "judge.base_url=http://127.0.0.1:8000/v1), eval.KEY=VALUE (eval.math500.prompts=FILE|HUB_ID: "
                   "benchmark accuracy; judge=none for that alone)")
    args = p.parse_intermixed_args(argv)
    try:
        r = evaluate_pair(args.run_dir, args.against, args.n_prompts, args.temperature, args.seed, args.overrides)
    except UserError as e:
        print(f"humanline: error: {_masked(str(e), args.overrides)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # eval trains nothing: say so, not cli.train's "before training"
        ignore_ctrl_c()  # a second Ctrl-C must not cut this line short
        print(f"humanline: eval of {args.run_dir} interrupted (Ctrl-C) before it finished; rerun the same command "
              f"(a result file is written only once its evaluation is complete)", file=sys.stderr)
        return 130
    if r.get("math500"):
        from humanline_cli.eval.math500 import summary_line

        print(f"{args.run_dir}: {summary_line(r['math500'])}")
    if "win_rate" not in r:  # eval.math500 alone (judge=none)
        return 0
    if r["accuracy"] is not None:
        metric = f"accuracy {r['accuracy']:.3f} vs {r['start_accuracy']:.3f}"
    elif r["reward_mean"] is not None:
        metric = f"judge reward {r['reward_mean']:.3f} vs {r['start_reward_mean']:.3f}"
    else:
        u = r["judge_usage"]
        metric = (f"{r['judge']}: {u['n_calls']} calls, {u['n_cache_hits']} cached, {u['n_unparsable']} unparsable "
                  f"pairs, {u['prompt_tokens']} + {u['completion_tokens']} tokens, ${u['cost_usd']:.4f}")
    if r.get("alpaca_eval"):  # judge=alpaca_eval: the paper's numbers, in alpaca_eval's percent
        u, a = r["judge_usage"], r["alpaca_eval"]
        lc = f"n/a ({a.get('lc_error') or 'no parsed pair'})" if a["lc_win_rate"] is None else \
            f"{a['lc_win_rate']:.2f} ± {a['lc_standard_error']:.2f}"
        wr = "n/a" if a["win_rate"] is None else f"{a['win_rate']:.2f} ± {a['standard_error'] or 0:.2f}"
        metric = (f"{r['judge']}: {u['n_calls']} calls, {u['n_cache_hits']} cached, {u['n_unparsable']} unparsed "
                  f"pairs, {u['total_tokens']} tokens, ${u['cost_usd']:.4f}; AlpacaEval WR {wr}, LC {lc}")
    if r["win_rate"] is None:  # every judgment unparsable: no result, however the run went
        print(f"humanline: error: {args.run_dir} vs {r['against']}: no parsable judgment, "
              f"{(r.get('judge_usage') or {}).get('n_unparsable', r['n_prompts'])} of {r['n_prompts']} pairs "
              f"unparsable; {metric}", file=sys.stderr)
        return 2
    lo, hi = r["win_rate_ci"]
    print(f"{args.run_dir} vs {r['against']}: win rate {r['win_rate']:.3f} [{lo:.3f}, {hi:.3f}] "
          f"(n={r['n_prompts']}, ties = 1/2, normal-approx 95% CI); {metric}")
    return 0
