"""Map a reward/judge config to a scorer with an explicit match on `kind`."""
from __future__ import annotations

import math
from collections.abc import Callable

from humanline_cli.errors import RunFailed, UserError

Scorer = Callable[[list[str], list[str], list | None], list[float]]


# when the caller does not say which config key a scorer came from, a remote-code error names them all
TRUST_KEYS = ("the trust_remote_code key of the config naming this model (task.judge.trust_remote_code=true, "
              "task.labeller.trust_remote_code=true or reward.trust_remote_code=true)")


def make_scorer(spec, device=None, key: str | None = None, loaded: dict | None = None) -> tuple[str, Scorer]:
    """Returns (name, scorer). The name is used in error messages and logs. `key` is where `spec`
    lives in the config (task.judge, task.labeller, reward), named in one-line load errors. `loaded`: the reward
    models this process already holds, by (path, trust_remote_code); a labeller and a judge naming the same model
    share one copy (an 8B ArmoRM is ~16 GB), each with its own batch size."""
    kind = spec.get("kind")
    match kind:
        case "world":
            from humanline_cli.world.rewards import score

            task, role = spec["task"], spec["role"]
            return f"world/{task}/{role}", lambda p, c, a=None: score(task, role, p, c)
        case "verifier":
            from humanline_cli.rewards.verifier import verify_batch

            method = spec.get("method", "math")
            if spec.get("weights"):  # the authors' math recipe: 8 x accuracy + format + tag_count
                from humanline_cli.rewards.think_format import weighted

                combined = weighted(spec["weights"], lambda c, a: verify_batch(c, a, method))
                return "verifier+format", lambda p, c, a=None: combined(c, a)
            return "verifier", lambda p, c, a=None: verify_batch(c, a, method)
        case "model" | "reward_model":
            from humanline_cli.rewards.reward_model import RewardModel

            trust = bool(spec.get("trust_remote_code", False))
            batch = spec.get("batch_size", 16)
            held = (loaded or {}).get((spec["name_or_path"], trust))
            if held is not None:
                return f"model:{spec['name_or_path']}", held.with_batch_size(batch)
            rm = RewardModel(spec["name_or_path"], device=device, batch_size=batch, trust_remote_code=trust,
                             trust_key=f"{key}.trust_remote_code" if key else TRUST_KEYS,
                             key=f"{key}.name_or_path" if key else "the reward model path")
            if loaded is not None:
                loaded[(spec["name_or_path"], trust)] = rm
            return f"model:{spec['name_or_path']}", rm
        case "lexicon":
            from humanline_cli.rewards.lexicon import scorer

            name = str(spec.get("lexicon") or "vader")
            return f"lexicon:{name}", scorer(name)
        case _:
            raise UserError(f"unknown reward kind {kind!r} in {key or 'reward'}.kind "
                            f"(verifier | model | lexicon | none; world for the bundled tasks)")


def checked(name: str, scorer: Scorer, prompts, completions, answers=None) -> list[float]:
    """Call a scorer and insist on one finite float per completion."""
    scores = list(scorer(prompts, completions, answers))
    if len(scores) != len(completions):
        raise RunFailed(f"reward {name} returned {len(scores)} scores for {len(completions)} completions")
    bad = [s for s in scores if not isinstance(s, (int, float)) or not math.isfinite(s)]
    if bad:
        raise RunFailed(f"reward {name} returned a non-finite score ({bad[0]!r})")
    return [float(s) for s in scores]
