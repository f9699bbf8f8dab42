"""Map config names to objects with explicit matches: paths, models, data source, sampler, evaluator.

Everything the trainer needs is assembled here; the trainer never sees config group names.
`world://NAME` paths point into the bundled world, built and cached on first use.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .backend import Backend, make_backend, seed_everything
from .config import RunSpec
from .data.collate import Collator, Encoder
from .data.examples import to_units
from .data.files import load_rows
from .data.sources import OfflineSource
from .errors import UserError
from .evaluate import Evaluator
from .models import load_policy, load_tokenizer, make_reference
from .rewards.build import make_scorer

WORLD = "world://"


def resolve_path(path: str, cfg: DictConfig, progress: bool = True) -> str:
    """Turn world://NAME into a real path inside the (built-on-demand) bundled world."""
    if not path.startswith(WORLD):
        return path
    world_cfg = OmegaConf.select(cfg, "task.world")
    if world_cfg is None:
        raise UserError(f"{path!r} refers to the bundled world, but task={cfg.task.name} has no world "
                        f"(use model=... / data.path=... with real paths)")
    from .world import materialise

    root = materialise(OmegaConf.to_container(world_cfg, resolve=True), Path(cfg.world_cache).expanduser(),
                       progress=progress)
    return str(root / path[len(WORLD):])


@dataclass
class Parts:
    backend: Backend
    tokenizer: object
    encoder: Encoder
    policy: object
    reference: object
    source: object
    evaluator: Evaluator
    eval_sampler: object
    reference_resets_each_round: bool


def build_parts(cfg: DictConfig, spec: RunSpec, timer, run_dir: Path) -> Parts:
    backend = make_backend(cfg.backend.device, cfg.backend.precision, cfg.threads)
    seed_everything(spec.seed)
    model_path = resolve_path(cfg.model.name_or_path, cfg)
    tok_path = resolve_path(cfg.model.tokenizer, cfg) if cfg.model.tokenizer else model_path
    trust = bool(cfg.model.trust_remote_code)
    tokenizer = load_tokenizer(tok_path, trust)
    encoder = Encoder(tokenizer, spec.train.max_prompt_length, spec.train.max_length,
                      wrap_strings=_wrap_strings(cfg, tokenizer))
    collate = Collator(encoder, cfg.objective)

    match spec.regime:
        case "offline":
            rows, where = load_rows(resolve_path(cfg.data.path, cfg), cfg.data.split, cfg.data.limit,
                                    _columns(cfg.data))
            units = to_units(rows, where, spec.objective, float(cfg.data.min_gap))
            encoder.check_prompts(rows, where)
            policy = load_policy(model_path, backend.device, trust)  # after the data: bad data fails fast
            source = OfflineSource(units, collate, spec.train.batch_size, spec.train.micro_batch_size,
                                   spec.seed, bool(cfg.data.shuffle))
        case "online":
            policy = load_policy(model_path, backend.device, trust)
            from .rollout import make_online_source

            source = make_online_source(cfg, spec, encoder, collate, policy, backend, resolve_path, timer, run_dir)
    reference = make_reference(policy)
    eval_rows, _ = load_rows(resolve_path(cfg.task.prompts.eval, cfg), cfg.task.prompts.get("eval_split", "train"),
                             cfg.eval.n_prompts, _columns(cfg.task.prompts))
    judge = make_scorer(OmegaConf.to_container(cfg.task.judge, resolve=True), backend.device)
    evaluator = Evaluator(eval_rows, encoder, judge, cfg.eval, bool(cfg.task.verifiable), spec.seed)
    eval_sampler = getattr(source, "sampler", None) or _hf_sampler(cfg, policy, tokenizer, backend)
    return Parts(backend, tokenizer, encoder, policy, reference, source, evaluator, eval_sampler,
                 reference_resets_each_round=spec.regime == "online" and not spec.humanline.sync)


def _columns(node) -> dict | None:
    cols = node.get("columns")
    return OmegaConf.to_container(cols) if cols else None


def _wrap_strings(cfg, tokenizer) -> bool:
    """chat_template=auto: string prompts become a user message when the tokenizer has a template."""
    mode = cfg.get("chat_template", "auto")
    if mode == "auto":
        return getattr(tokenizer, "chat_template", None) is not None
    return bool(mode)


def _hf_sampler(cfg, policy, tokenizer, backend):
    from .sampling.hf import HFSampler

    return HFSampler(policy, tokenizer, int(cfg.eval.batch_size), backend.autocast)
