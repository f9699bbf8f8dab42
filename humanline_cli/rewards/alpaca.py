"""AlpacaEval 2 through the `alpaca-eval` package (pip install 'humanline[alpaca]'): the paper's metric.

Consumes prompts and two lists of replies (A, the policy evaluated; B, the reference, e.g. the start).
Maps them to alpaca_eval's formats (`model_outputs` = A as `output_2`, `reference_outputs` = B as
`output_1`, each row {instruction, output, generator}), runs alpaca_eval's own `PairwiseAnnotator` with
an annotator config, and reads the results with alpaca_eval's own metrics:

- win rate (WR): `metrics.get_winrate`, mean over parsed pairs of (preference - 1) x 100, with its
  standard error. With the weighted annotator (logprob_parser, is_binarize false) a pair's preference
  is 2 - p(m) / (p(m) + p(M)) from the judge's top-5 logprobs of its one-token answer, after undoing
  alpaca_eval's seeded random swap of the two outputs (preference -> 3 - preference when swapped).
- length-controlled win rate (LC): `metrics.get_length_controlled_winrate` (GLM "length_controlled_v1",
  fitted on tanh of the standardised length difference, the instruction difficulty and the gamed
  baselines, which it reads from the hub dataset tatsu-lab/alpaca_eval's df_gamed.csv; the difficulties
  are indexed by position in the 805 AlpacaEval prompts, so LC means what the paper's LC means only on
  that set in its order). `lc_data` (judge.lc_data) names a local copy of that file, for offline machines;
  where it cannot be had (offline, no HF cache, no lc_data) LC is null and `lc_error` says what to do.

The default annotator is the authors' (templates/alpaca_eval_gpt-4.1.yaml: weighted AlpacaEval 2 with
gpt-4.1, max_tokens 1, logprobs, top_logprobs 5); `annotator` may also name one of alpaca_eval's own
configs or a YAML file. `model` replaces the config's model_name; `base_url` is any OpenAI-compatible
server. The key is read from the variable named by `api_key_env` and handed to alpaca_eval in memory
(decoding kwargs), never written: the generated config holds no key.

Caching is alpaca_eval's own (its annotations JSON keyed by instruction, both outputs and annotator),
one file per (config, model, base_url), so two judges never share answers. Unparsed annotations are not
cached (they are dropped from alpaca_eval's file after each run): a later run asks again.

tiktoken: alpaca_eval's openai decoder imports tiktoken but calls it only for tokens_to_avoid /
tokens_to_favor (logit biases), which no AlpacaEval 2 annotator sets; token counts and cost come from the
server's `usage.total_tokens`. So no tiktoken encoding is ever downloaded.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from humanline_cli.atomic import write_json_atomic
from humanline_cli.errors import UserError, one_line
from humanline_cli.rewards.llm_judge import endpoint
from humanline_cli.schema import AlpacaEvalOptions, JudgeConnection

AUTHORS_ANNOTATOR = "alpaca_eval_gpt-4.1"  # templates/alpaca_eval_gpt-4.1.yaml
MODEL_NAME, REFERENCE_NAME = "model", "reference"  # generator_2 / generator_1 in the annotations
RAW = "preference_raw_completion"
PRICE = "preference_price_per_example"


@dataclass
class AlpacaEvalSpec(AlpacaEvalOptions, JudgeConnection):
    """The judge's settings: the schema's (judge=alpaca_eval)."""

    def __post_init__(self):
        bad = self.connection_problems() + ([] if self.annotator else [f"annotator={self.annotator!r}"])
        if bad:
            raise UserError(f"bad alpaca_eval judge setting: {', '.join(bad)}")
        if self.lc_data is not None:
            check_gamed_file(self.lc_data)


GAMED_COLUMNS = ("index", "instruction_difficulty", "preference", "std_delta_len", "not_gamed_baseline", "model")
GAMED_HINT = ("fetch it once (huggingface-cli download tatsu-lab/alpaca_eval df_gamed.csv --repo-type dataset) "
              "or point judge.lc_data at a copy")


def check_gamed_file(path: str) -> None:
    """judge.lc_data: a readable CSV with the columns alpaca_eval's LC GLM reads from df_gamed.csv."""
    import csv

    p = Path(path)
    if not p.is_file():
        raise UserError(f"judge.lc_data {path} does not exist (a copy of tatsu-lab/alpaca_eval's df_gamed.csv)")
    try:
        with open(p, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"judge.lc_data {path}: cannot read it as CSV ({e})") from None
    missing = [c for c in GAMED_COLUMNS if c not in header]
    if missing:
        raise UserError(f"{path}:1: judge.lc_data has no column(s) {missing}: not alpaca_eval's df_gamed.csv")


class GamedDataMissing(Exception):
    """alpaca_eval's LC could not get df_gamed.csv (offline, not in the HF cache)."""


@contextmanager
def gamed_data(lc_data: str | None):
    """alpaca_eval's LC GLM reads the gamed baselines and instruction difficulties (df_gamed.csv of the hub
    dataset tatsu-lab/alpaca_eval; not in the package) only through `glm_winrate.hf_hub_download`: the hub,
    or the HF cache offline. With `lc_data` it is handed that local copy instead (nothing downloaded); a
    download that fails becomes GamedDataMissing with one line saying what to do."""
    from alpaca_eval.metrics import glm_winrate

    original = glm_winrate.hf_hub_download

    def fetch(*args, **kwargs):
        if lc_data is not None:
            return str(lc_data)
        try:
            return original(*args, **kwargs)
        except Exception as e:
            cause = " ".join(str(e).split())[:160]
            raise GamedDataMissing(f"LC needs df_gamed.csv from the hub dataset tatsu-lab/alpaca_eval, which could "
                                   f"not be fetched ({type(e).__name__}: {cause}); {GAMED_HINT}") from None

    glm_winrate.hf_hub_download = fetch
    try:
        yield
    finally:
        glm_winrate.hf_hub_download = original


def _configs_dir() -> Path:
    from alpaca_eval import constants

    return Path(constants.EVALUATORS_CONFIG_DIR)


def load_annotator(name: str) -> tuple[dict, Path]:
    """(the annotator config {name: settings}, the folder its relative prompt_template is read from)."""
    if name == AUTHORS_ANNOTATOR:
        text = resources.files(__package__).joinpath("templates/alpaca_eval_gpt-4.1.yaml").read_text(encoding="utf-8")
        return yaml.safe_load(text), _configs_dir()
    path = Path(name).expanduser()
    if name.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise UserError(f"judge.annotator: no such annotator config file {name}")
        base = path.resolve().parents[1]  # where alpaca_eval itself resolves a file config's template
    else:
        path = _configs_dir() / name / "configs.yaml"
        if not path.is_file():
            known = sorted(p.name for p in _configs_dir().iterdir() if (p / "configs.yaml").is_file())
            raise UserError(f"judge.annotator: unknown annotator {name!r} (a YAML file, {AUTHORS_ANNOTATOR}, "
                            f"or one of alpaca_eval's: {', '.join(known)})")
        base = _configs_dir()
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"judge.annotator: cannot read {path}: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(cfg, dict) or not cfg or not all(isinstance(v, dict) for v in cfg.values()):
        raise UserError(f"judge.annotator: {path} is not an alpaca_eval annotator config ({{name: settings}})")
    return cfg, base


def runtime_config(cfg: dict, base: Path, spec: AlpacaEvalSpec) -> dict:
    """The config alpaca_eval runs: the judge's model, our price, the template as an absolute path."""
    out = {}
    for name, a in cfg.items():
        a = json.loads(json.dumps(a))  # a deep copy
        if a.get("fn_completions", "openai_completions") != "openai_completions":
            raise UserError(f"judge=alpaca_eval drives OpenAI-compatible annotators; {name} uses {a['fn_completions']}")
        template = Path(str(a.get("prompt_template", "")))
        for candidate in ([template] if template.is_absolute() else [base / template, _configs_dir() / template]):
            if candidate.is_file():
                a["prompt_template"] = str(candidate)
                break
        else:
            raise UserError(f"judge.annotator: {name}'s prompt_template {str(template)!r} not found")
        kw = a.setdefault("completions_kwargs", {})
        kw["model_name"] = spec.model
        kw["price_per_token"] = spec.price_input_per_mtok / 1e6  # max_tokens 1: the input is the bill
        out[name] = a
    return out


class _AlpacaLog(logging.Filter):
    """alpaca_eval logs through the root logger (warnings, tracebacks of failed requests): keep them out
    of the console, remember the last error for our one-line message."""

    def __init__(self):
        super().__init__()
        self.last_error: str | None = None
        self.no_logprobs = 0  # completions the parser failed on because they carry no logprobs

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}alpaca_eval{os.sep}" not in (record.pathname or ""):
            return True
        if record.levelno >= logging.ERROR:
            msg = record.getMessage()
            self.last_error = " ".join(msg.split())[:200]
            # the annotator drops an unparsable completion from its rows, so this log line (the parser's
            # failure with the completion printed) is where a reply without logprobs shows
            if msg.startswith("Error while parsing completion") and "'logprobs': None" in msg:
                self.no_logprobs += 1
        return False


@contextmanager
def _quiet_alpaca():
    f = _AlpacaLog()
    root = logging.getLogger()
    root.addFilter(f)
    try:
        yield f
    finally:
        root.removeFilter(f)


@dataclass
class AlpacaEvalResult:
    outcomes: list[float | None]  # for A: preference - 1 in [0, 1]; None = unparsed
    records: list[dict]  # alpaca_eval's annotation rows, in the prompts' order
    metrics: dict  # the `alpaca_eval` section of the summary
    n_calls: int = 0  # pairs asked of the server in this compare()
    n_cache_hits: int = 0  # pairs answered from alpaca_eval's cache
    total_tokens: int = 0  # of this compare()'s requests (server usage)
    cost_usd: float = 0.0  # of this compare()'s requests
    n_unparsable: int = field(init=False)

    def __post_init__(self):
        self.n_unparsable = sum(o is None for o in self.outcomes)

    def totals(self) -> dict:
        return {"n_pairs": len(self.outcomes), "n_unparsable": self.n_unparsable, "n_calls": self.n_calls,
                "n_cache_hits": self.n_cache_hits, "n_retries": None, "prompt_tokens": None,
                "completion_tokens": None, "total_tokens": self.total_tokens, "cost_usd": self.cost_usd}

    def sections(self) -> dict:
        return {"alpaca_eval": self.metrics}

    def save(self, samples_path: Path) -> Path:
        """alpaca_eval's annotations.json format, next to the samples file."""
        path = samples_path.with_name(samples_path.stem + "_alpaca_eval_annotations.json")
        write_json_atomic(path, self.records)
        return path


def read_reference_outputs(path: str, instructions: list[str]) -> list[str]:
    """The reference reply for each eval prompt from a file in AlpacaEval's format (a .json list or .jsonl
    of {instruction, output, ...}, e.g. the benchmark's own baseline outputs), matched by instruction."""
    from humanline_cli.data.files import load_rows

    rows, where = load_rows(path)
    by_instruction: dict[str, str] = {}
    for i, r in enumerate(rows):
        if not isinstance(r.get("instruction"), str) or not isinstance(r.get("output"), str):
            raise UserError(f"{where(i)}: a reference output needs string fields 'instruction' and 'output'")
        by_instruction.setdefault(r["instruction"], r["output"])
    missing = [i for i, p in enumerate(instructions) if p not in by_instruction]
    if missing:
        first = instructions[missing[0]]
        raise UserError(f"{path}: no output for {len(missing)} of {len(instructions)} eval prompts (first: eval prompt "
                        f"{missing[0] + 1}, {first[:60]!r})")
    return [by_instruction[p] for p in instructions]


def _num(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


class AlpacaEvalJudge:
    def __init__(self, spec: AlpacaEvalSpec, seed: int = 0):
        try:
            import alpaca_eval  # noqa: F401
            import openai
        except ImportError as e:  # the package, or one it imports (e.g. setuptools' pkg_resources)
            raise UserError(f"judge=alpaca_eval needs the alpaca-eval package and its dependencies "
                            f"(pip install 'humanline[alpaca]'): cannot import {e.name or e}") from None
        self.spec, self.seed, self._openai = spec, seed, openai
        self.name = f"alpaca_eval/{spec.model}"
        self.base_url, self._secret = endpoint(spec.base_url, spec.api_key_env, "alpaca_eval judge")
        cfg, base = load_annotator(spec.annotator)
        self.config = runtime_config(cfg, base, spec)
        self.annotator_names = sorted(self.config)
        kw = next(iter(self.config.values()))["completions_kwargs"]
        self.needs_logprobs = bool(kw.get("logprobs"))
        blob = json.dumps([self.config, spec.model, self.base_url], sort_keys=True)
        digest = hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]
        if spec.cache_dir:
            self.workdir = Path(spec.cache_dir).expanduser() / f"{Path(spec.annotator).stem}-{digest}"
            self.caching_path: Path | None = self.workdir / "annotations.json"
        else:
            self.workdir, self.caching_path = Path(tempfile.mkdtemp(prefix="humanline-alpaca-")), None
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "configs.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False), encoding="utf-8")

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _cached_pairs(self) -> set[tuple[str, str, str]]:
        if self.caching_path is None or not self.caching_path.is_file():
            return set()
        try:
            rows = json.loads(self.caching_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return set()
        return {(r["instruction"], r["output_1"], r["output_2"]) for r in rows
                if r.get("annotator") in self.annotator_names and _num(r.get("preference")) is not None}

    def compare(self, prompts: list[str], replies_a: list[str], replies_b: list[str]) -> AlpacaEvalResult:
        if not len(prompts) == len(replies_a) == len(replies_b):
            raise ValueError(f"compare needs equal lengths, got {len(prompts)}, {len(replies_a)}, {len(replies_b)}")
        from alpaca_eval import metrics
        from alpaca_eval.annotators import PairwiseAnnotator

        model = [{"instruction": p, "output": a, "generator": MODEL_NAME} for p, a in zip(prompts, replies_a)]
        ref = [{"instruction": p, "output": b, "generator": REFERENCE_NAME} for p, b in zip(prompts, replies_b)]
        before = self._cached_pairs()
        asked = {(p, b, a) for p, a, b in zip(prompts, replies_a, replies_b)} - before
        oa, s = self._openai, self.spec
        decoding = dict(openai_api_keys=[self._secret], openai_api_base=self.base_url, openai_organization_ids=None,
                        client_config_path=os.devnull,  # no client-config file: the key and URL given here
                        client_kwargs={"timeout": s.timeout_s, "max_retries": s.max_retries},
                        num_procs=s.max_concurrency, n_retries=1)  # retries: the client's, counted once
        with _quiet_alpaca() as log:
            try:
                annotator = PairwiseAnnotator(annotators_config=str(self.config_path), seed=self.seed,
                                              caching_path=self.caching_path)
                rows = annotator.annotate_head2head(outputs_1=ref, outputs_2=model, is_ordered=True, **decoding)
            except (oa.AuthenticationError, oa.PermissionDeniedError) as e:
                raise UserError(f"alpaca_eval judge: authentication failed at {self.base_url} (HTTP {e.status_code}); "
                                f"check ${s.api_key_env}: {self._line(e)}") from None
            except oa.APIStatusError as e:
                raise UserError(f"alpaca_eval judge: {self.base_url} rejected the request for model {s.model!r} "
                                f"(HTTP {e.status_code}): {self._line(e)}") from None
            except oa.APITimeoutError:
                raise UserError(f"alpaca_eval judge: no answer from {self.base_url} within timeout_s={s.timeout_s} "
                                f"after {s.max_retries + 1} tries") from None
            except oa.APIConnectionError as e:
                raise UserError(f"alpaca_eval judge: cannot reach {self.base_url} after {s.max_retries + 1} tries: "
                                f"{self._line(e.__cause__ or e)}") from None
            finally:
                self._drop_missing()
        if len(rows) != len(prompts):
            raise RuntimeError(f"alpaca_eval returned {len(rows)} annotations for {len(prompts)} pairs")
        prefs = [_num(r.get("preference")) for r in rows]
        if self.needs_logprobs and log.no_logprobs:
            raise UserError(f"alpaca_eval judge: {self.base_url} answered model {s.model!r} without logprobs "
                            f"({log.no_logprobs} of {len(rows)} pairs); the annotator {s.annotator} reads "
                            "top_logprobs: use a server that returns them (vLLM, OpenAI)")
        fresh = [r for r in rows if (r["instruction"], r["output_1"], r["output_2"]) in asked]
        tokens = sum(_tokens(r.get(RAW)) for r in fresh)
        cost_fresh = sum(_num(r.get(PRICE)) or 0.0 for r in fresh)
        section = self._metrics(rows, metrics, cost_fresh, tokens, log)
        outcomes = [None if p is None else p - 1.0 for p in prefs]
        return AlpacaEvalResult(outcomes, [_plain(r) for r in rows], section, n_calls=len(asked),
                                n_cache_hits=len(rows) - len(fresh), total_tokens=tokens, cost_usd=cost_fresh)

    def _drop_missing(self) -> None:
        """alpaca_eval stores an unparsed annotation as -1 and would serve it forever; drop those rows.
        (Its is_store_missing_annotations=False fails on a fresh cache in 0.6.6.)"""
        if self.caching_path is None or not self.caching_path.is_file():
            return
        try:
            rows = json.loads(self.caching_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        keep = [r for r in rows if (_num(r.get("preference")) if _num(r.get("preference")) is not None else -1.0) >= 0]
        if len(keep) != len(rows):
            write_json_atomic(self.caching_path, keep)

    def _metrics(self, rows: list[dict], metrics, cost_fresh: float, tokens: int, log: _AlpacaLog) -> dict:
        import pandas as pd

        df = pd.DataFrame(rows)
        df["preference"] = pd.to_numeric(df["preference"])  # None (unparsed) -> NaN, as alpaca_eval expects
        wr = metrics.get_winrate(df)
        out = {"win_rate": _num(wr["win_rate"]), "standard_error": _num(wr["standard_error"]),
               "lc_win_rate": None, "lc_standard_error": None, "lc_error": None,
               "n": len(rows), "n_unparsed": int(df["preference"].isna().sum()), "n_wins": int(wr["n_wins"]),
               "n_draws": int(wr["n_draws"]), "annotator": self.spec.annotator, "model": self.spec.model,
               "cost_usd": float(sum(_num(r.get(PRICE)) or 0.0 for r in rows)), "cost_usd_this_run": cost_fresh,
               "total_tokens_this_run": tokens}
        if out["n_unparsed"] < len(rows):
            try:
                with gamed_data(self.spec.lc_data):
                    lc = metrics.get_length_controlled_winrate(df.copy(), save_weights_dir=None,
                                                               is_add_glm_preference_inplace=False)
                out["lc_win_rate"], out["lc_standard_error"] = _num(lc["length_controlled_winrate"]), \
                    _num(lc["lc_standard_error"])
            except GamedDataMissing as e:  # offline without the file: WR stands, LC says why
                out["lc_error"] = str(e)
            except Exception as e:  # a degenerate fit: WR stands
                out["lc_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        return out

    def _line(self, e: BaseException) -> str:
        """One line of an error's text, at most 200 characters, with the key masked if a server echoed it."""
        return one_line(e, self._secret, 200)


def _tokens(raw) -> int:
    return int(_num(raw.get("total_tokens")) or 0) if isinstance(raw, dict) else 0


def _plain(row: dict) -> dict:
    """A JSON-safe annotation row (NaN -> None)."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
