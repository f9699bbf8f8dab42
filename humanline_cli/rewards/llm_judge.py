"""LLM judge: AlpacaEval-2-style pairwise comparisons through any OpenAI-compatible chat API
(the paper's instruction-following win rates are judged by GPT-4.1).

Consumes prompts and two lists of replies (A, e.g. the trained policy; B, e.g. the starting policy).
Produces a `PairwiseResult`: per pair the outcome for A (1.0 win, 0.5 tie, 0.0 loss, None when no
order gave a parsable verdict: counted in `n_unparsable`, never turned into a tie), a record with the
raw judge text of every order asked (for eval_samples.jsonl), both replies' lengths in characters and
whitespace tokens (the covariates of a length-controlled win rate), and totals: API calls, cache hits,
retries, tokens, estimated USD.

The template has placeholders {instruction}, {output_a}, {output_b} and asks for one word: "A"
(the output shown first is better), "B" (the one shown second) or "tie"; `parse_verdict` also accepts
messy variants ("**B**", "[[A]]", "Output (b)", "The better output is A."). With `both_orders` every
pair is asked as (A, B) and as (B, A), which cancels position bias: orders that disagree make a tie,
a single parsable order decides alone. Without it the order alternates with the pair index.

The API key is read from the environment variable named by `api_key_env` when the judge is built;
it is never stored in the spec, the cache, the records or an error message.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from importlib import resources
from pathlib import Path
from urllib.parse import urlparse

from humanline_cli.atomic import write_json_atomic
from humanline_cli.errors import UserError, one_line
from humanline_cli.rewards.verdict import combine, outcome_for_a, parse_verdict
from humanline_cli.schema import JudgeConnection, LLMJudgeOptions

DEFAULT_BASE_URL = "https://api.openai.com/v1"
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "0.0.0.0")
PLACEHOLDERS = ("instruction", "output_a", "output_b")
ORDERS = ("ab", "ba")  # "ab": reply A is shown first (as Output (A)); "ba": reply B is shown first
CACHE_VERSION = 2  # 2: the server is part of the judge's identity (version 1 keys had no server)


@dataclass
class LLMJudgeSpec(LLMJudgeOptions, JudgeConnection):
    """The judge's settings: the schema's (judge=llm), plus the retry backoff, which is not a config key."""
    backoff_base_s: float = 1.0  # exponential backoff base; a Retry-After header overrides it
    backoff_max_s: float = 60.0

    def __post_init__(self):
        bad = self.connection_problems() + [f"{k}={getattr(self, k)!r}" for k, ok in [
            ("max_tokens", self.max_tokens >= 1), ("temperature", self.temperature >= 0),
            ("backoff_base_s", self.backoff_base_s >= 0),
            ("price_output_per_mtok", self.price_output_per_mtok >= 0)] if not ok]
        if bad:
            raise UserError(f"bad LLM judge setting: {', '.join(bad)}")


# -- template, parsing, outcomes: pure functions -------------------------------------------------------
def load_template(path: str | None) -> str:
    if path is None:
        text = resources.files(__package__).joinpath("templates/pairwise.txt").read_text(encoding="utf-8")
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot read LLM judge template {path}: {e.strerror}") from None
    missing = [p for p in PLACEHOLDERS if "{" + p + "}" not in text]
    if missing:
        raise UserError(f"LLM judge template {path or 'pairwise.txt'} lacks {', '.join('{' + m + '}' for m in missing)}")
    return text


def render(template: str, instruction: str, output_a: str, output_b: str) -> str:
    """Fill the placeholders in one pass: braces or placeholder names inside the texts stay as written."""
    values = {"instruction": instruction, "output_a": output_a, "output_b": output_b}
    return re.sub(r"\{(instruction|output_a|output_b)\}", lambda m: values[m.group(1)], template)


def judge_server(base_url: str) -> str:
    """The server part of a judge's identity: the URL without a trailing slash, its scheme and host lower-cased
    (`HTTP://Host:8000/v1/` and `http://host:8000/v1` are one server)."""
    u = urlparse(base_url.strip())
    return u._replace(scheme=u.scheme.lower(), netloc=u.netloc.lower()).geturl().rstrip("/")


def cache_key(server: str, model: str, template_sha: str, prompt: str, first: str, second: str,
              temperature: float = 0.0, max_tokens: int = 16) -> str:
    """sha256 over everything that identifies the judge and decides its answer. A judge is the server
    (`judge_server` of the resolved base_url), the model name it serves, the template (its sha256) and the
    sampling settings (temperature, max_tokens): one model name on two servers may be two different models
    (a local vLLM's served name, a quantised deployment), so one server's verdicts never answer for
    another's. Then the question: the prompt and both replies in the order shown."""
    blob = json.dumps([CACHE_VERSION, server, model, template_sha, prompt, first, second, float(temperature),
                       int(max_tokens)], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def estimate_cost_usd(prompt_tokens: int, completion_tokens: int, spec: LLMJudgeSpec) -> float:
    return (prompt_tokens * spec.price_input_per_mtok + completion_tokens * spec.price_output_per_mtok) / 1e6


def retry_delay(attempt: int, headers, base_s: float, max_s: float, rng: random.Random) -> float:
    """Seconds to wait before retry `attempt` (0-based): the server's Retry-After (retry-after-ms,
    seconds or an HTTP date) when given, else base * 2**attempt capped at max_s, with 50-100% jitter."""
    headers = headers or {}
    try:
        if headers.get("retry-after-ms") is not None:
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
        if headers.get("retry-after") is not None:
            value = headers["retry-after"]
            try:
                return max(0.0, float(value))
            except ValueError:
                return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        pass  # an unreadable header: fall back to our own backoff
    step = min(max_s, base_s * 2 ** attempt)
    return step * (0.5 + 0.5 * rng.random())


def endpoint(base_url: str | None, api_key_env: str, who: str) -> tuple[str, str]:
    """The server's URL (`base_url`, else $OPENAI_BASE_URL, else the OpenAI API) and the key read from the
    variable named `api_key_env` (held in memory only). A local server may go without a key."""
    url = base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    key = os.environ.get(api_key_env)
    if not key:
        if not is_local(url):
            raise UserError(f"{who} at {url} needs an API key: set ${api_key_env}")
        key = "EMPTY"  # local servers (vllm serve without --api-key) ignore it
    return url, key


def is_local(base_url: str) -> bool:
    host = urlparse(base_url).hostname or ""
    return host in LOCAL_HOSTS or host.startswith("127.")


# -- results --------------------------------------------------------------------------------------------
@dataclass
class PairwiseResult:
    outcomes: list[float | None]  # for A; None = unparsable in every order asked
    records: list[dict]  # per pair: index, outcome, orders [{order, raw, verdict, outcome, cached}], lengths
    n_calls: int = 0  # requests answered by the server in this compare() (retries not counted)
    n_cache_hits: int = 0  # judgements served without a request (n_calls + n_cache_hits = judgements)
    n_retries: int = 0
    prompt_tokens: int = 0  # usage of this compare()'s requests; cache hits cost nothing
    completion_tokens: int = 0
    cost_usd: float = 0.0
    n_unparsable: int = field(init=False)

    def __post_init__(self):
        self.n_unparsable = sum(o is None for o in self.outcomes)

    def win_rate(self) -> float | None:
        """Mean outcome over the parsable pairs (ties 1/2); None if there are none."""
        got = [o for o in self.outcomes if o is not None]
        return sum(got) / len(got) if got else None

    def totals(self) -> dict:
        return {"n_pairs": len(self.outcomes), "n_unparsable": self.n_unparsable, "n_calls": self.n_calls,
                "n_cache_hits": self.n_cache_hits, "n_retries": self.n_retries, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cost_usd": self.cost_usd}

    def sections(self) -> dict:
        """Summary sections of the judge's own ({}: its win rate is the summary's)."""
        return {}

    def save(self, samples_path) -> None:
        """No annotations file of its own: the verdicts are the samples file's outcomes."""


class _Cache:
    """One JSON file per key under root/<key[:2]>/; written atomically, so concurrent runs may share it."""

    def __init__(self, root: str | None):
        self.root = Path(root) if root else None

    def get(self, key: str) -> dict | None:
        if self.root is None:
            return None
        try:
            return json.loads((self.root / key[:2] / f"{key}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def put(self, key: str, entry: dict) -> None:
        if self.root is None:
            return
        path = self.root / key[:2] / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        # judge threads may write one key at once: each its own temp file
        write_json_atomic(path, entry, None, path.with_name(f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"))


class _Cancelled(Exception):
    """Another request of the same compare() failed; stop quietly."""


# -- the judge ------------------------------------------------------------------------------------------
class LLMJudge:
    def __init__(self, spec: LLMJudgeSpec, seed: int = 0):
        try:
            import openai
        except ImportError:
            raise UserError("the LLM judge needs the openai client: pip install 'openai>=1.40'") from None
        self.spec = spec
        self.name = f"llm/{spec.model}"  # the judge named in summary.json
        self.base_url, self._secret = endpoint(spec.base_url, spec.api_key_env, "LLM judge")
        self.template = load_template(spec.template)
        self.template_sha = hashlib.sha256(self.template.encode("utf-8")).hexdigest()
        self._cache = _Cache(spec.cache_dir)
        self._rng = random.Random(seed)
        self._openai = openai
        # Retries are ours (counted, cancellable, one-line errors), so the client's own are off.
        self._client = openai.OpenAI(api_key=self._secret, base_url=self.base_url, timeout=spec.timeout_s, max_retries=0)

    def close(self) -> None:
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def cache_key(self, prompt: str, first: str, second: str) -> str:
        s = self.spec
        return cache_key(judge_server(self.base_url), s.model, self.template_sha, prompt, first, second, s.temperature,
                         s.max_tokens)

    def compare(self, prompts: list[str], replies_a: list[str], replies_b: list[str]) -> PairwiseResult:
        if not len(prompts) == len(replies_a) == len(replies_b):
            raise ValueError(f"compare needs equal lengths, got {len(prompts)}, {len(replies_a)}, {len(replies_b)}")
        # Every (pair, order) judgement is a slot; identical slots share one request.
        slots: list[list[tuple[str, str]]] = []
        pending: dict[str, str] = {}
        answers: dict[str, dict] = {}
        for i, (p, a, b) in enumerate(zip(prompts, replies_a, replies_b)):
            orders = ORDERS if self.spec.both_orders else (ORDERS[i % 2],)
            slots.append([])
            for order in orders:
                first, second = (a, b) if order == "ab" else (b, a)
                key = self.cache_key(p, first, second)
                slots[-1].append((order, key))
                if key in answers or key in pending:
                    continue
                hit = self._cache.get(key)
                if hit is not None and isinstance(hit.get("raw"), str):
                    answers[key] = hit
                else:
                    pending[key] = render(self.template, p, first, second)
        fresh = self._run(pending)
        answers.update(fresh)

        records, outcomes = [], []
        for i, pair in enumerate(slots):
            asked = []
            for order, key in pair:
                raw = answers[key]["raw"]
                verdict = parse_verdict(raw)
                asked.append({"order": order, "raw": raw, "verdict": verdict, "outcome": outcome_for_a(order, verdict),
                              "cached": key not in fresh})
            outcome = combine([o["outcome"] for o in asked])
            a, b = replies_a[i], replies_b[i]
            records.append({"index": i, "outcome": outcome, "orders": asked,
                            "orders_used": [o["order"] for o in asked if o["verdict"] is not None],
                            "chars_a": len(a), "chars_b": len(b), "words_a": len(a.split()), "words_b": len(b.split())})
            outcomes.append(outcome)
        n_slots = sum(len(pair) for pair in slots)
        pt = sum(r["prompt_tokens"] for r in fresh.values())
        ct = sum(r["completion_tokens"] for r in fresh.values())
        return PairwiseResult(outcomes, records, n_calls=len(fresh), n_cache_hits=n_slots - len(fresh),
                              n_retries=sum(r["retries"] for r in fresh.values()), prompt_tokens=pt,
                              completion_tokens=ct, cost_usd=estimate_cost_usd(pt, ct, self.spec))

    def _run(self, pending: dict[str, str]) -> dict[str, dict]:
        """Ask every pending prompt, at most max_concurrency at a time; cache each answer as it lands,
        so an interrupted evaluation resumes where it stopped. The first failure cancels the rest."""
        if not pending:
            return {}
        stop = threading.Event()
        fresh: dict[str, dict] = {}
        with ThreadPoolExecutor(max_workers=min(self.spec.max_concurrency, len(pending))) as pool:
            futures = {pool.submit(self._request, text, stop): key for key, text in pending.items()}
            try:
                for fut in as_completed(futures):
                    key, answer = futures[fut], fut.result()
                    self._cache.put(key, {"v": CACHE_VERSION, "server": judge_server(self.base_url),
                                          "model": self.spec.model, "template_sha": self.template_sha, **answer})
                    fresh[key] = answer
            except BaseException:
                stop.set()
                for f in futures:
                    f.cancel()
                raise
        return fresh

    def _request(self, text: str, stop: threading.Event) -> dict:
        oa, s = self._openai, self.spec
        attempt = 0
        while True:
            if stop.is_set():
                raise _Cancelled()
            headers = None
            try:
                resp = self._client.chat.completions.create(
                    model=s.model, messages=[{"role": "user", "content": text}],
                    temperature=s.temperature, max_tokens=s.max_tokens, n=1)
                usage = resp.usage
                return {"raw": (resp.choices[0].message.content or "") if resp.choices else "",
                        "prompt_tokens": int(getattr(usage, "prompt_tokens", 0) or 0),
                        "completion_tokens": int(getattr(usage, "completion_tokens", 0) or 0), "retries": attempt}
            except (oa.AuthenticationError, oa.PermissionDeniedError) as e:
                raise UserError(f"LLM judge: authentication failed at {self.base_url} (HTTP {e.status_code}); "
                                f"check ${s.api_key_env}: {self._line(e)}") from None
            except oa.APIStatusError as e:
                if e.status_code not in (408, 409, 429) and e.status_code < 500:
                    raise UserError(f"LLM judge: {self.base_url} rejected the request for model {s.model!r} "
                                    f"(HTTP {e.status_code}): {self._line(e)}") from None
                failure, headers = f"HTTP {e.status_code}", e.response.headers
            except oa.APITimeoutError:
                failure = f"no answer within timeout_s={s.timeout_s}"
            except oa.APIConnectionError as e:
                failure = f"connection failed: {self._line(e.__cause__ or e)}"
            if attempt >= s.max_retries:
                raise UserError(f"LLM judge: cannot get an answer from {self.base_url} after {attempt + 1} tries "
                                f"({failure})") from None
            delay = retry_delay(attempt, headers, s.backoff_base_s, s.backoff_max_s, self._rng)
            attempt += 1
            if stop.wait(delay):
                raise _Cancelled()

    def _line(self, e: BaseException) -> str:
        """One line of an error's text, at most 200 characters, with the key masked if a server echoed it."""
        return one_line(e, self._secret, 200)
