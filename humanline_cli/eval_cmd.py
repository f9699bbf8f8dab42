"""`humanline eval RUN_DIR [--against RUN_DIR|start]`: pairwise win rate of one trained policy
against another run's policy or the starting policy, under the run's task judge, on the task's
held-out prompts, with a 95% CI. Writes eval_vs_<name>.json into RUN_DIR."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from .errors import UserError


def _run_spec(run_dir: Path):
    from .config import load_saved

    path = run_dir / ".hydra" / "config.yaml"
    if not path.exists():
        raise UserError(f"{run_dir} is not a run dir (no .hydra/config.yaml)")
    if not (run_dir / "model" / "config.json").exists():
        raise UserError(f"{run_dir} has no saved model (model/); was it trained with train.save_model=true?")
    return load_saved(path)


def evaluate_pair(run_dir: Path, against: str, n_prompts: int | None, temperature: float | None,
                  seed: int) -> dict:
    """Rebuilds the run's evaluator with the same builder `humanline train` used (its eval split,
    column names, chat-template wrapping and judge), so both evaluate identical prompts."""
    from .backend import make_backend, seed_everything
    from .build import build_evaluator, make_encoder, model_paths
    from .models import load_policy, load_tokenizer
    from .sampling.hf import HFSampler

    spec = _run_spec(run_dir)
    ev = spec.eval_cfg
    changes = {k: v for k, v in (("n_prompts", n_prompts), ("temperature", temperature)) if v is not None}
    if changes:
        spec = replace(spec, eval_cfg=replace(ev, **changes))
    if against == "start":
        other_path, other_name = model_paths(spec)[0], "start"
    else:
        other_dir = Path(against)
        _run_spec(other_dir)
        other_path, other_name = str(other_dir / "model"), other_dir.name
    b = spec.backend_cfg
    backend = make_backend(b.device.value, b.precision.value, spec.threads)
    seed_everything(seed)
    trust = spec.model_cfg.trust_remote_code
    tok = load_tokenizer(str(run_dir / "model"), trust)
    evaluator = build_evaluator(spec, make_encoder(spec, tok), backend.device, seed)
    batch = spec.eval_cfg.batch_size
    other = load_policy(other_path, backend.device, trust).eval()
    evaluator.set_baseline(HFSampler(other, tok, batch, backend.autocast))
    del other
    policy = load_policy(str(run_dir / "model"), backend.device, trust).eval()
    result = evaluator.evaluate(HFSampler(policy, tok, batch, backend.autocast),
                                run_dir / f"eval_vs_{other_name}_samples.jsonl")
    result = {"run": str(run_dir), "against": other_name, "seed": seed, **result}
    (run_dir / f"eval_vs_{other_name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main_eval(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="humanline eval", description=__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--against", default="start", help="another run dir, or 'start' (default)")
    p.add_argument("--n-prompts", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        r = evaluate_pair(args.run_dir, args.against, args.n_prompts, args.temperature, args.seed)
    except UserError as e:
        print(f"humanline: error: {e}", file=sys.stderr)
        return 2
    lo, hi = r["win_rate_ci"]
    metric = (f"accuracy {r['accuracy']:.3f} vs {r['start_accuracy']:.3f}" if r["accuracy"] is not None
              else f"judge reward {r['reward_mean']:.3f} vs {r['start_reward_mean']:.3f}")
    print(f"{args.run_dir} vs {r['against']}: win rate {r['win_rate']:.3f} [{lo:.3f}, {hi:.3f}] "
          f"(n={r['n_prompts']}, ties = 1/2, normal-approx 95% CI); {metric}")
    return 0
