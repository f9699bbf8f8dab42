"""Run outputs: metrics.jsonl (one JSON object per logged step), summary.json, and a wandb run.

wandb is optional at run time: any wandb failure is reported once and training continues.
Secrets are masked wherever a run writes a config or a summary: resolved_config.json, summary.json, the wandb
config and command line, and Hydra's .hydra/*.yaml and multirun.yaml (`mask_saved_configs`). Two rules, one
function each: the values of keys NAMED like a credential (api_key, hf_token, password, client_secret, GITHUB_PAT,
...; by key name, word by word, so eval.max_new_tokens, model.tokenizer or a judge's api_key_env, the NAME of a
variable, stay visible), and any string SHAPED like one wherever it stands (a URL's password, a token with a known
prefix: errors.mask_secrets, which the one-line error form uses too).
"""
from __future__ import annotations

import contextlib
import json
import re
import sys
import warnings
from pathlib import Path

from humanline_cli.atomic import write_json_atomic, write_text_atomic
from humanline_cli.errors import MASK, cannot_write, mask_secrets

# the last word of a key's name that marks its value as a credential ...
SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "passphrase", "apikey", "key", "credential",
                          "credentials", "authorization", "pat"})
# ... unless the word before says it is something else (tokenizer special tokens, lookup keys)
NOT_SECRET = {"token": frozenset({"eos", "bos", "pad", "unk", "sep", "cls", "mask", "special", "start", "end", "stop"}),
              "key": frozenset({"sort", "group", "join", "metric", "dict", "primary", "foreign", "column", "row",
                                "cache", "seed", "prompt", "answer", "label"})}
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# one override ("+a.b=v", "~x=", "a/b=c"): split a joined list only at commas that start the next one
_OVERRIDE = re.compile(r"^(?P<key>[+~]{0,2}[\w.\-/@]+)=(?P<value>.*)$", re.S)
_NEXT_OVERRIDE = re.compile(r",(?=[+~]{0,2}[\w.\-/@]+=)")


def is_secret_key(name) -> bool:
    """True when a config key's NAME marks its value as a credential: its last word (words split at
    `_`, `-`, `.`, camelCase) is token/secret/password/key/..., e.g. api_key, apiKey, hf_token,
    wandb.api_key, client_secret, db_password; not max_new_tokens, tokenizer, api_key_env, eos_token."""
    words = [w.lower() for w in _WORD.findall(str(name).rsplit(".", 1)[-1].rsplit("/", 1)[-1])]
    if not words or words[-1] not in SECRET_WORDS:
        return False
    return not (len(words) > 1 and words[-2] in NOT_SECRET.get(words[-1], ()))


def scrub(obj):
    """A copy of a config (dicts, lists) with the values of secret-named keys replaced by ***, and every other
    string's secret-shaped parts (mask_secrets)."""
    if isinstance(obj, dict):
        return {k: (MASK if v is not None and is_secret_key(k) else scrub(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v) for v in obj]
    return mask_secrets(obj) if isinstance(obj, str) else obj


def mask_values(obj):
    """A copy of `obj` (dicts, lists) with every string's secret-shaped parts masked, keys kept as they are (a
    summary's metric names are not config keys)."""
    if isinstance(obj, dict):
        return {k: mask_values(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [mask_values(v) for v in obj]
    return mask_secrets(obj) if isinstance(obj, str) else obj


def scrub_override(text: str) -> str:
    """Mask the value of one command-line override (or a comma-joined list of them, like Hydra's
    override_dirname) whose key is secret-named: `+wandb.api_key=abc` -> `+wandb.api_key=***`; and the
    secret-shaped parts of any other (`judge.base_url=https://u:***@host`)."""
    if not isinstance(text, str) or "=" not in text:
        return mask_secrets(text)
    parts = []
    for part in _NEXT_OVERRIDE.split(text):
        m = _OVERRIDE.match(part)
        parts.append(f"{m['key']}={MASK}" if m and m["value"] and is_secret_key(m["key"].lstrip("+~")) else part)
    return mask_secrets(",".join(parts))


def scrub_argv(argv: list[str]) -> list[str]:
    """A command line with secret override values masked (what wandb records as the run's args)."""
    return [scrub_override(a) for a in argv]


def _scrub_saved(obj):
    """scrub() plus override strings anywhere in the tree (hydra.overrides.*, job.override_dirname)."""
    if isinstance(obj, dict):
        return {k: (MASK if v is not None and is_secret_key(k) else _scrub_saved(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_scrub_saved(v) for v in obj]
    return scrub_override(obj) if isinstance(obj, str) else obj


def masked_config(node) -> str:
    """A config (DictConfig, ListConfig, dict or list) as YAML with secrets masked, interpolations kept as
    written (what Hydra's own .hydra/*.yaml holds)."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node
    return OmegaConf.to_yaml(OmegaConf.create(_scrub_saved(data)))


def mask_saved_configs(paths) -> list[Path]:
    """Rewrite Hydra's saved configs (.hydra/config.yaml, hydra.yaml, overrides.yaml, a sweep's
    multirun.yaml) with secrets masked; Hydra writes them before the job starts. Interpolations are
    kept as written. Returns the files that changed (each replaced atomically)."""
    from omegaconf import OmegaConf

    changed = []
    for path in map(Path, paths):
        if not path.is_file():
            continue
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        clean = _scrub_saved(data)
        if clean != data:
            write_text_atomic(path, OmegaConf.to_yaml(OmegaConf.create(clean)), path.with_name(f".{path.name}.tmp"))
            changed.append(path)
    return changed


WANDB_ID = "wandb_id.txt"  # the run's wandb id: a resumed run continues the same wandb run


class Tracker:
    def __init__(self, run_dir: Path, config: dict, wandb_cfg: dict, name: str, resume: bool = False):
        """resume: the run continues from a checkpoint (its step-indexed files were rewound to it), so
        metrics are appended and wandb continues the interrupted run (saved id, resume="allow")."""
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self._f = open(self.metrics_path, "a")
        self.wandb = None
        mode = wandb_cfg.get("mode") or "offline"
        if mode == "disabled":
            return
        try:
            import wandb

            run_id = self._wandb_id(resume)
            with _masked_argv():  # wandb records the command line as the run's args
                self.wandb = wandb.init(project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity"),
                                        mode=mode, dir=str(run_dir), name=name, config=scrub(config),
                                        tags=list(wandb_cfg.get("tags") or []), reinit="finish_previous",
                                        id=run_id, resume="allow" if resume else None)
        except Exception as e:  # a wandb failure never kills training
            warnings.warn(f"wandb disabled for this run: {type(e).__name__}: {e}")
            self.wandb = None

    def _wandb_id(self, resume: bool) -> str:
        """The interrupted run's wandb id when resuming, else a new one (saved in the run dir)."""
        import uuid

        path = self.run_dir / WANDB_ID
        old = path.read_text().strip() if resume and path.is_file() else ""
        if old:
            return old
        run_id = uuid.uuid4().hex[:12]
        write_text_atomic(path, run_id + "\n")
        return run_id

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **metrics}
        try:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()
        except OSError as e:
            raise cannot_write(self.metrics_path, e) from e
        self._wandb_call("log", metrics, step=step)

    def log_histogram(self, step: int, counts: list[int]) -> None:
        """Token log-ratio histogram (logratios.jsonl): underflow, 60 bins over [-3, 3], overflow."""
        path = self.run_dir / "logratios.jsonl"
        try:
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, "lo": -3.0, "hi": 3.0, "counts": counts}) + "\n")
        except OSError as e:
            raise cannot_write(path, e) from e

    def summary(self, summary: dict) -> None:
        summary = mask_values(summary)
        write_json_atomic(self.run_dir / "summary.json", summary)
        if self.wandb is not None:
            try:
                flat = {}
                _flatten(summary, "", flat)
                self.wandb.summary.update(flat)
            except Exception as e:
                warnings.warn(f"wandb summary failed: {e}")

    def _wandb_call(self, method: str, *args, **kwargs) -> None:
        if self.wandb is None:
            return
        try:
            getattr(self.wandb, method)(*args, **kwargs)
        except Exception as e:
            warnings.warn(f"wandb disabled after error: {type(e).__name__}: {e}")
            self.wandb = None

    def finish(self, exit_code: int = 0) -> None:
        with contextlib.suppress(OSError):  # a full disk was reported when the row was written
            self._f.close()
        if self.wandb is not None:
            try:
                self.wandb.finish(exit_code=exit_code)
            except Exception as e:
                warnings.warn(f"wandb finish failed: {e}")
            self.wandb = None


@contextlib.contextmanager
def _masked_argv():
    saved = sys.argv
    sys.argv = scrub_argv(saved)
    try:
        yield
    finally:
        sys.argv = saved


def _flatten(d: dict, prefix: str, out: dict) -> None:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            _flatten(v, key + ".", out)
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v


class NullTracker:
    """What ranks other than 0 log to: nothing (rank 0 writes every output)."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def log_histogram(self, step: int, counts: list[int]) -> None:
        pass

    def summary(self, summary: dict) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass
