"""`humanline eval RUN_DIR [--against RUN_DIR|start]`: pairwise win rate of one trained policy
against another run's policy or the starting policy, under the run's task judge, on the task's
held-out prompts, with a 95% CI. Writes eval_vs_<name>.json into RUN_DIR."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from .errors import UserError


def _run_config(run_dir: Path):
    path = run_dir / ".hydra" / "config.yaml"
    if not path.exists():
        raise UserError(f"{run_dir} is not a run dir (no .hydra/config.yaml)")
    if not (run_dir / "model" / "config.json").exists():
        raise UserError(f"{run_dir} has no saved model (model/); was it trained with train.save_model=true?")
    return OmegaConf.load(path)


def evaluate_pair(run_dir: Path, against: str, n_prompts: int | None, temperature: float | None,
                  seed: int) -> dict:
    from .backend import make_backend, seed_everything
    from .build import resolve_path
    from .data.collate import Encoder
    from .data.files import load_rows
    from .evaluate import Evaluator
    from .models import load_policy, load_tokenizer
    from .rewards.build import make_scorer
    from .sampling.hf import HFSampler

    cfg = _run_config(run_dir)
    if n_prompts is not None:
        cfg.eval.n_prompts = n_prompts
    if temperature is not None:
        cfg.eval.temperature = temperature
    if against == "start":
        other_path, other_name = resolve_path(cfg.model.name_or_path, cfg), "start"
    else:
        other_dir = Path(against)
        _run_config(other_dir)
        other_path, other_name = str(other_dir / "model"), other_dir.name
    backend = make_backend(cfg.backend.device, cfg.backend.precision, cfg.get("threads"))
    seed_everything(seed)
    trust = bool(cfg.model.trust_remote_code)
    tok = load_tokenizer(str(run_dir / "model"), trust)
    encoder = Encoder(tok, int(cfg.train.max_prompt_length), int(cfg.train.max_length))
    rows, _ = load_rows(resolve_path(cfg.task.prompts.eval, cfg), "train", cfg.eval.n_prompts)
    judge = make_scorer(OmegaConf.to_container(cfg.task.judge, resolve=True), backend.device)
    evaluator = Evaluator(rows, encoder, judge, cfg.eval, bool(cfg.task.verifiable), seed)
    other = load_policy(other_path, backend.device, trust).eval()
    evaluator.set_baseline(HFSampler(other, tok, int(cfg.eval.batch_size), backend.autocast))
    del other
    policy = load_policy(str(run_dir / "model"), backend.device, trust).eval()
    result = evaluator.evaluate(HFSampler(policy, tok, int(cfg.eval.batch_size), backend.autocast),
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
