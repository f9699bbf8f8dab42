"""The behaviour log-probs of offline data, for the corrections that weigh each token by them (correction=tis, mis,
decoupled; core/corrections.py). Online rounds carry the sampler's own; a fixed dataset carries none, so the
trainer computes them, once per sequence, from the policy that generated the data, where that policy is known:
data written by `humanline sample` (a stale generation) has its card.json beside it, naming the model that
sampled it (`model_path`). Any other offline data is refused in one line before any weights load.

The log-probs are the trainer's own token_logps of the data under that policy (at the run's log-prob temperature),
the quantity an online sampler reports and the trainer checks it against (docs/method.md: log_softmax before the
top-p filter). When the card names the run's own starting policy, the behaviour policy IS the run's fixed
reference (plain offline: it never moves), so the reference itself serves them (and its cache, if on): the
weights are then exactly 1 and the correction reduces to `none`, as it should on data the starting policy drew.
Another model (an earlier checkpoint's generation) is loaded once, frozen, and its log-probs cached per sequence.
"""
from __future__ import annotations

import json
from pathlib import Path

from humanline_cli.core.corrections import IS_KINDS
from humanline_cli.core.interfaces import Reference
from humanline_cli.errors import UserError

CARD = "card.json"  # cli/sample.py writes it beside groups.jsonl, pairs.jsonl and unpaired.jsonl


def needs_behaviour(spec) -> bool:
    """Offline data under a correction that weighs tokens by the behaviour policy's log-probs."""
    return spec.regime == "offline" and spec.correction.kind in IS_KINDS


def behaviour_model_path(spec, data_path: str) -> str:
    """The model that generated the offline data at `data_path`, from the card `humanline sample` wrote beside
    it; one line naming what is missing where the data does not say (no card, an unreadable one, a model that
    is not on this machine)."""
    kind = spec.correction.kind
    where = Path(data_path)
    card = (where if where.is_dir() else where.parent) / CARD
    if not card.is_file():
        raise UserError(f"correction={kind} weighs each token by the log-probs of the policy that generated the "
                        f"data, and {data_path} does not say which policy that was (no {CARD} of `humanline "
                        f"sample` beside it): use data sampled by `humanline sample`, or data=online")
    try:
        model = json.loads(card.read_text(encoding="utf-8")).get("model_path")
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"cannot read {card} (the policy that generated the data, for correction={kind}): "
                        f"{getattr(e, 'strerror', None) or e}") from None
    if not isinstance(model, str) or not Path(model).exists():
        raise UserError(f"correction={kind}: the policy that generated {data_path} ({card}: model_path "
                        f"{model!r}) is not on this machine, so its log-probs cannot be computed")
    return model


def build_behaviour(behaviour_path: str, model_path: str, reference: Reference, load) -> Reference:
    """The run's behaviour policy as a Reference whose `logps` gives each sequence's behaviour log-probs: the
    run's fixed reference when the data's policy is the starting one (`model_path`), else `load(path)`'s
    model, frozen, cached per sequence (computed once)."""
    from humanline_cli.core.reference import CachedReference, FrozenCopy

    if Path(behaviour_path).resolve() == Path(model_path).resolve():
        return reference
    return CachedReference(FrozenCopy(None, built=load(behaviour_path)))


def with_behaviour(batches: list, behaviour: Reference | None) -> list:
    """Each micro-batch with the behaviour policy's log-probs where it has none (a behaviour policy is built for
    offline GRPO only: GroupBatch is the batch that carries them)."""
    import dataclasses

    if behaviour is None:
        return batches
    return [mb if mb.sampler_logps is not None
            else dataclasses.replace(mb, sampler_logps=behaviour.logps(mb.seqs)) for mb in batches]
