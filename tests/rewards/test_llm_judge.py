"""LLM judge (rewards/llm_judge.py): template, verdict parser, tie rule, cache key, retries and errors
against a stub OpenAI-style server on 127.0.0.1. The end-to-end tests through a real `vllm serve` are in
test_llm_judge_vllm.py."""
from __future__ import annotations

import json
import re
import time
from email.utils import formatdate
from pathlib import Path

import pytest

from humanline_cli.errors import UserError
from humanline_cli.rewards.llm_judge import (
    LLMJudge,
    LLMJudgeSpec,
    cache_key,
    estimate_cost_usd,
    judge_server,
    load_template,
    render,
    retry_delay,
)
from tests.helpers.served import Stub, completion, free_port

TEMPLATE = load_template(None)


def shown(body: dict) -> tuple[str, str]:
    """The (first, second) outputs inside a rendered bundled-template request."""
    text = body["messages"][-1]["content"]
    m = re.search(r"## Output \(A\)\n(.*)\n\n## Output \(B\)\n(.*)\n\n## Verdict", text, re.S)
    return m.group(1), m.group(2)


def content_judge(body, n, headers):
    """Prefers the output containing GOOD; tie when both or neither do."""
    first, second = shown(body)
    a, b = "GOOD" in first, "GOOD" in second
    return 200, {}, completion("A" if a and not b else "B" if b and not a else "tie")


def spec_for(url: str, tmp_path: Path | None = None, **kw) -> LLMJudgeSpec:
    defaults = dict(model="stub-judge", base_url=url, api_key_env="HUMANLINE_TEST_NO_SUCH_KEY",
                    backoff_base_s=0.01, max_retries=2, timeout_s=10,
                    cache_dir=str(tmp_path / "cache") if tmp_path else None)
    return LLMJudgeSpec(**{**defaults, **kw})


# -- pure functions -------------------------------------------------------------------------------------
def test_render_fills_each_placeholder_once_and_keeps_braces():
    text = render(TEMPLATE, "Sum {x} and 2?", "It is {output_b}.", "{}")
    assert "## Instruction\nSum {x} and 2?\n\n## Output (A)\nIt is {output_b}.\n\n## Output (B)\n{}\n\n## Verdict" in text
    assert "{instruction}" not in text and "{output_a}" not in text
    assert text.count("It is {output_b}.") == 1  # the reply's own "{output_b}" was not expanded
    assert text.rstrip().endswith("A if Output (A) is better, B if Output (B) is better, or tie.")


def test_custom_template_is_read_and_checked(tmp_path):
    good = tmp_path / "t.txt"
    good.write_text("Q: {instruction}\n1: {output_a}\n2: {output_b}\nA, B or tie?")
    assert render(load_template(str(good)), "q", "x", "y") == "Q: q\n1: x\n2: y\nA, B or tie?"
    bad = tmp_path / "bad.txt"
    bad.write_text("Q: {instruction}\n1: {output_a}\n")
    with pytest.raises(UserError, match=r"lacks \{output_b\}"):
        load_template(str(bad))
    with pytest.raises(UserError, match="cannot read LLM judge template"):
        load_template(str(tmp_path / "missing.txt"))


def test_cache_key_stable_and_sensitive():
    server = "https://api.openai.com/v1"
    base = (server, "gpt-4.1", "t" * 64, "prompt", "first reply", "second reply")
    k = cache_key(*base)
    assert k == cache_key(*base) and re.fullmatch(r"[0-9a-f]{64}", k)
    assert cache_key("http://127.0.0.1:8000/v1", *base[1:]) != k  # the server
    assert cache_key(server, "gpt-4.1-mini", *base[2:]) != k  # judge model
    assert cache_key(server, base[1], "u" * 64, *base[3:]) != k  # template hash
    assert cache_key(*base[:4], base[5], base[4]) != k  # order shown
    assert cache_key(*base[:3], "prompt!", *base[4:]) != k
    assert cache_key(*base, max_tokens=17) != k and cache_key(*base, temperature=0.7) != k
    # field boundaries are unambiguous (json list, not concatenation)
    assert cache_key(server, "m", "t", "ab", "c", "d") != cache_key(server, "m", "t", "a", "bc", "d")
    # one server however its URL is spelled; another path or port is another server
    assert judge_server("HTTP://LocalHost:8000/v1/") == judge_server("http://localhost:8000/v1") == \
        "http://localhost:8000/v1"
    assert judge_server("http://localhost:8001/v1") != judge_server("http://localhost:8000/v1")


def test_retry_delay_honours_retry_after_else_backs_off_with_jitter():
    import random

    rng = random.Random(0)
    assert retry_delay(0, {"retry-after": "0"}, 1.0, 60, rng) == 0.0
    assert retry_delay(5, {"retry-after": "2"}, 1.0, 60, rng) == 2.0
    assert retry_delay(0, {"retry-after-ms": "250", "retry-after": "9"}, 1.0, 60, rng) == 0.25
    date = formatdate(time.time() + 30, usegmt=True)
    assert 27 <= retry_delay(0, {"retry-after": date}, 1.0, 60, rng) <= 30
    # no header: base * 2**attempt, times a jitter factor in [0.5, 1.0], capped at backoff_max_s
    for attempt, lo, hi in [(0, 0.5, 1.0), (1, 1.0, 2.0), (3, 4.0, 8.0), (10, 30.0, 60.0)]:
        delays = [retry_delay(attempt, None, 1.0, 60.0, rng) for _ in range(50)]
        assert all(lo <= d <= hi for d in delays) and len(set(delays)) > 1
    assert 0.5 <= retry_delay(0, {"retry-after": "soon"}, 1.0, 60, rng) <= 1.0  # unreadable header


def test_cost_estimate_hand_computed():
    spec = LLMJudgeSpec()  # gpt-4.1 list prices: 2.00 in, 8.00 out per million tokens
    # 2000 * 2.00 / 1e6 + 500 * 8.00 / 1e6 = 0.004 + 0.004
    assert estimate_cost_usd(2000, 500, spec) == pytest.approx(0.008)
    cheap = LLMJudgeSpec(price_input_per_mtok=0.40, price_output_per_mtok=1.60)
    # 1_000_000 * 0.40 / 1e6 + 250_000 * 1.60 / 1e6 = 0.40 + 0.40
    assert estimate_cost_usd(1_000_000, 250_000, cheap) == pytest.approx(0.80)


def test_spec_rejects_bad_settings():
    with pytest.raises(UserError, match=r"max_concurrency=0.*timeout_s=0"):
        LLMJudgeSpec(max_concurrency=0, timeout_s=0)
    with pytest.raises(UserError, match="price_output_per_mtok=-1"):
        LLMJudgeSpec(price_output_per_mtok=-1)


# -- against the stub server ----------------------------------------------------------------------------
def test_compare_asks_both_orders_and_scores_pairs(tmp_path):
    prompts = ["p0", "p1", "p2", "p3"]
    a = ["GOOD answer here", "meh", "GOOD too", "neither"]
    b = ["bad", "GOOD one", "GOOD as well", "nope"]
    with Stub(content_judge) as stub, LLMJudge(spec_for(stub.url, tmp_path)) as judge:
        res = judge.compare(prompts, a, b)
    assert res.outcomes == [1.0, 0.0, 0.5, 0.5]
    assert len(stub.requests) == 8 and res.n_calls == 8 and res.n_cache_hits == 0 and res.n_unparsable == 0
    assert {tuple(shown(r["body"])) for r in stub.requests} == {(x, y) for p in zip(a, b) for x, y in (p, p[::-1])}
    body = stub.requests[0]["body"]
    assert stub.requests[0]["path"] == "/v1/chat/completions"
    assert body["model"] == "stub-judge" and body["temperature"] == 0.0 and body["max_tokens"] == 16
    r0 = res.records[0]
    assert [(o["order"], o["raw"], o["verdict"], o["outcome"]) for o in r0["orders"]] == [
        ("ab", "A", "A", 1.0), ("ba", "B", "B", 1.0)]
    assert r0["orders_used"] == ["ab", "ba"] and r0["outcome"] == 1.0 and r0["index"] == 0
    assert (r0["chars_a"], r0["chars_b"], r0["words_a"], r0["words_b"]) == (16, 3, 3, 1)
    assert res.records[2]["orders"][0]["verdict"] == "tie" and res.records[2]["outcome"] == 0.5
    assert res.win_rate() == pytest.approx((1.0 + 0.0 + 0.5 + 0.5) / 4)
    assert res.prompt_tokens == 80 and res.completion_tokens == 8
    assert json.loads(json.dumps(res.records)) == res.records  # ready for eval_samples.jsonl


def test_position_biased_judge_gives_ties_and_one_order_alternates(tmp_path):
    always_first = lambda body, n, h: (200, {}, completion("**A**"))  # noqa: E731
    with Stub(always_first) as stub, LLMJudge(spec_for(stub.url)) as judge:
        res = judge.compare(["p", "q"], ["x", "y"], ["u", "v"])
        assert res.outcomes == [0.5, 0.5] and len(stub.requests) == 4
        assert [o["outcome"] for o in res.records[0]["orders"]] == [1.0, 0.0]
    with Stub(always_first) as stub, LLMJudge(spec_for(stub.url, both_orders=False)) as judge:
        res = judge.compare(["p", "q", "r"], ["x", "y", "z"], ["u", "v", "w"])
    # one order per pair, alternating ab, ba, ab: the first-position judge then scores 1, 0, 1
    assert len(stub.requests) == 3 and [r["orders"][0]["order"] for r in res.records] == ["ab", "ba", "ab"]
    assert res.outcomes == [1.0, 0.0, 1.0]


def test_unparsable_orders_counted_not_tied(tmp_path):
    def respond(body, n, h):
        first, _ = shown(body)
        # pair 0: only the ab order parses; pair 1: nothing parses; pair 2: ab says A, ba says tie
        return 200, {}, completion({"x0": "Output (a)", "y0": "I cannot tell.", "x1": "", "y1": "hmm",
                                    "x2": "[[A]]", "y2": "tie"}[first])
    with Stub(respond) as stub, LLMJudge(spec_for(stub.url)) as judge:
        res = judge.compare(["p0", "p1", "p2"], ["x0", "x1", "x2"], ["y0", "y1", "y2"])
    assert res.outcomes == [1.0, None, 0.5]
    assert res.n_unparsable == 1 and res.totals()["n_unparsable"] == 1
    assert res.records[0]["orders_used"] == ["ab"] and res.records[0]["orders"][1]["raw"] == "I cannot tell."
    assert res.records[1]["orders_used"] == [] and [o["raw"] for o in res.records[1]["orders"]] == ["", "hmm"]
    assert res.win_rate() == pytest.approx((1.0 + 0.5) / 2)  # the caller sees None; win_rate skips it


def test_second_compare_is_served_from_cache(tmp_path):
    args = (["p0", "p1"], ["GOOD", "x"], ["y", "GOOD"])
    with Stub(content_judge) as stub:
        with LLMJudge(spec_for(stub.url, tmp_path)) as judge:
            first = judge.compare(*args)
            assert len(stub.requests) == 4 and first.n_calls == 4
        with LLMJudge(spec_for(stub.url, tmp_path)) as judge:  # a new judge, same cache dir
            again = judge.compare(*args)
        assert len(stub.requests) == 4  # zero new requests
        assert again.n_calls == 0 and again.n_cache_hits == 4 and again.outcomes == first.outcomes == [1.0, 0.0]
        assert again.prompt_tokens == 0 and again.cost_usd == 0.0
        assert all(o["cached"] for r in again.records for o in r["orders"])
        assert [o["raw"] for o in again.records[0]["orders"]] == [o["raw"] for o in first.records[0]["orders"]]
        files = sorted((tmp_path / "cache").rglob("*.json"))
        assert len(files) == 4 and not list((tmp_path / "cache").rglob("*.tmp"))
        entry = json.loads(files[0].read_text())
        assert set(entry) == {"v", "server", "model", "template_sha", "raw", "prompt_tokens", "completion_tokens",
                              "retries"}
        assert entry["server"] == stub.url and entry["v"] == 2
        # a different judge model (or template) misses the cache
        with LLMJudge(spec_for(stub.url, tmp_path, model="other-judge")) as judge:
            other = judge.compare(*args)
        assert other.n_calls == 4 and len(stub.requests) == 8
    # identical pairs inside one compare share one request
    with Stub(content_judge) as stub, LLMJudge(spec_for(stub.url)) as judge:
        dup = judge.compare(["p", "p"], ["GOOD", "GOOD"], ["z", "z"])
    assert len(stub.requests) == 2 and dup.n_calls == 2 and dup.n_cache_hits == 2 and dup.outcomes == [1.0, 1.0]


def test_another_server_misses_the_cache(tmp_path):
    """The server is part of the judge's identity: cached verdicts answer only for the server that gave them."""
    args = (["p0", "p1"], ["GOOD", "x"], ["y", "GOOD"])
    with Stub(content_judge) as stub:
        with LLMJudge(spec_for(stub.url, tmp_path)) as judge:
            assert judge.compare(*args).n_calls == 4
        with LLMJudge(spec_for(stub.url + "/", tmp_path)) as judge:  # the same server, spelled with a slash
            assert judge.compare(*args).n_cache_hits == 4 and len(stub.requests) == 4
        with Stub(content_judge) as other, LLMJudge(spec_for(other.url, tmp_path)) as judge:
            res = judge.compare(*args)  # same model name, template and settings on another server: asked again
        assert res.n_calls == 4 and res.n_cache_hits == 0 and len(other.requests) == 4
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there: no verdict from another server's cache
    with LLMJudge(spec_for(url, tmp_path, max_retries=0)) as judge, pytest.raises(UserError) as e:
        judge.compare(*args)
    assert str(e.value).startswith(f"LLM judge: cannot get an answer from {url} after 1 tries (connection failed")


def test_retries_429_and_503_then_succeeds(tmp_path):
    script = [(429, {"Retry-After": "0"}, {"error": {"message": "rate limited", "type": "rate_limit"}}),
              (503, {"Retry-After": "0"}, {"error": {"message": "overloaded"}}),
              (200, {}, completion("B", 7, 2))]
    with Stub(lambda body, n, h: script[n]) as stub, LLMJudge(spec_for(stub.url, both_orders=False)) as judge:
        res = judge.compare(["p"], ["x"], ["y"])
    assert len(stub.requests) == 3 and res.n_calls == 1 and res.n_retries == 2
    assert res.outcomes == [0.0] and (res.prompt_tokens, res.completion_tokens) == (7, 2)


def test_retry_after_header_is_honoured():
    script = [(429, {"Retry-After": "1"}, {"error": {"message": "slow down"}}), (200, {}, completion("A"))]
    with Stub(lambda body, n, h: script[n]) as stub, \
            LLMJudge(spec_for(stub.url, both_orders=False, backoff_base_s=0.0)) as judge:
        t0 = time.monotonic()
        res = judge.compare(["p"], ["x"], ["y"])
        elapsed = time.monotonic() - t0
    assert res.outcomes == [1.0] and len(stub.requests) == 2
    assert 1.0 <= elapsed < 8.0  # own backoff would have been 0 s


def test_retries_exhausted_is_one_line_error():
    with Stub(lambda body, n, h: (503, {}, {"error": {"message": "down"}})) as stub, \
            LLMJudge(spec_for(stub.url, both_orders=False)) as judge, pytest.raises(UserError) as e:
        judge.compare(["p"], ["x"], ["y"])
    assert str(e.value) == f"LLM judge: cannot get an answer from {stub.url} after 3 tries (HTTP 503)"
    assert len(stub.requests) == 3


def test_unreachable_server_is_one_line_error():
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with LLMJudge(spec_for(url, both_orders=False)) as judge, pytest.raises(UserError) as e:
        judge.compare(["p"], ["x"], ["y"])
    msg = str(e.value)
    assert msg.startswith(f"LLM judge: cannot get an answer from {url} after 3 tries (connection failed: ")
    assert "\n" not in msg and len(msg) < 400


def test_timeout_is_retried_then_one_line_error():
    with Stub(lambda body, n, h: (200, {}, completion("A")), delay_s=2.0) as stub, \
            LLMJudge(spec_for(stub.url, both_orders=False, timeout_s=0.3, max_retries=1)) as judge:
        t0 = time.monotonic()
        with pytest.raises(UserError) as e:
            judge.compare(["p"], ["x"], ["y"])
        elapsed = time.monotonic() - t0
    assert str(e.value) == f"LLM judge: cannot get an answer from {stub.url} after 2 tries (no answer within timeout_s=0.3)"
    assert len(stub.requests) == 2 and elapsed < 1.9  # two 0.3 s timeouts, not one 2 s wait


def test_auth_failure_is_one_line_error_without_retry_or_key(monkeypatch):
    key = "sk-test-auth-4242424242"
    monkeypatch.setenv("HUMANLINE_TEST_JUDGE_KEY", key)

    def reject(body, n, headers):  # echoes the key back, as some servers do
        return 401, {}, {"error": {"message": f"Incorrect API key provided: {headers['authorization']}\nsee docs"}}
    with Stub(reject) as stub:
        spec = spec_for(stub.url, api_key_env="HUMANLINE_TEST_JUDGE_KEY", both_orders=False)
        with LLMJudge(spec) as judge, pytest.raises(UserError) as e:
            judge.compare(["p"], ["x"], ["y"])
    msg = str(e.value)
    assert msg.startswith(f"LLM judge: authentication failed at {stub.url} (HTTP 401); check $HUMANLINE_TEST_JUDGE_KEY")
    assert key not in msg and "Bearer ***" in msg and "\n" not in msg
    assert len(stub.requests) == 1 and stub.requests[0]["auth"] == f"Bearer {key}"


def test_rejected_request_is_one_line_error():
    with Stub(lambda body, n, h: (400, {}, {"error": {"message": "max_tokens is too large"}})) as stub, \
            LLMJudge(spec_for(stub.url, both_orders=False)) as judge, pytest.raises(UserError) as e:
        judge.compare(["p"], ["x"], ["y"])
    assert str(e.value).startswith(f"LLM judge: {stub.url} rejected the request for model 'stub-judge' (HTTP 400): ")
    assert "max_tokens is too large" in str(e.value) and len(stub.requests) == 1


def test_missing_key_for_remote_url_fails_early_local_url_uses_dummy(monkeypatch):
    monkeypatch.delenv("HUMANLINE_TEST_NO_SUCH_KEY", raising=False)
    with pytest.raises(UserError) as e:
        LLMJudge(spec_for("https://judge.example.invalid/v1"))
    assert str(e.value) == ("LLM judge at https://judge.example.invalid/v1 needs an API key: "
                            "set $HUMANLINE_TEST_NO_SUCH_KEY")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(UserError, match="https://api.openai.com/v1 needs an API key: set \\$OPENAI_API_KEY"):
        LLMJudge(LLMJudgeSpec())
    with Stub(content_judge) as stub:
        monkeypatch.setenv("OPENAI_BASE_URL", stub.url)  # base_url None: taken from the environment
        with LLMJudge(LLMJudgeSpec(model="m", both_orders=False)) as judge:
            assert judge.compare(["p"], ["GOOD"], ["x"]).outcomes == [1.0]
    assert stub.requests[0]["auth"] == "Bearer EMPTY"


def test_cost_from_server_usage(tmp_path):
    with Stub(lambda body, n, h: (200, {}, completion("A", 1000, 250))) as stub, \
            LLMJudge(spec_for(stub.url, tmp_path)) as judge:
        res = judge.compare(["p"], ["x"], ["y"])
    assert (res.n_calls, res.prompt_tokens, res.completion_tokens) == (2, 2000, 500)
    # 2000 * 2.00 / 1e6 + 500 * 8.00 / 1e6
    assert res.cost_usd == pytest.approx(0.004 + 0.004)
    assert res.totals() == {"n_pairs": 1, "n_unparsable": 0, "n_calls": 2, "n_cache_hits": 0, "n_retries": 0,
                            "prompt_tokens": 2000, "completion_tokens": 500, "cost_usd": pytest.approx(0.008)}


def test_api_key_never_written(tmp_path, monkeypatch):
    key = "sk-test-NEVER-WRITE-7f3a9c"
    monkeypatch.setenv("HUMANLINE_TEST_JUDGE_KEY", key)
    with Stub(content_judge) as stub:
        spec = spec_for(stub.url, tmp_path, api_key_env="HUMANLINE_TEST_JUDGE_KEY")
        with LLMJudge(spec) as judge:
            res = judge.compare(["p", "q"], ["GOOD", "x"], ["y", "z"])
            (tmp_path / "records.jsonl").write_text("\n".join(json.dumps(r) for r in res.records))
            (tmp_path / "totals.json").write_text(json.dumps({**res.totals(), "spec": repr(spec)}))
    assert {r["auth"] for r in stub.requests} == {f"Bearer {key}"}  # the key was really used
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) >= 6  # 4 cache entries + records + totals
    for p in files:
        assert key.encode() not in p.read_bytes(), p
    assert key not in repr(spec) and key not in repr(LLMJudgeSpec.__dataclass_fields__)


def test_concurrency_is_bounded(tmp_path):
    with Stub(content_judge, delay_s=0.15) as stub, LLMJudge(spec_for(stub.url, max_concurrency=3)) as judge:
        res = judge.compare([f"p{i}" for i in range(6)], [f"a{i}" for i in range(6)], [f"b{i}" for i in range(6)])
    assert len(stub.requests) == 12 and res.n_calls == 12
    assert 2 <= stub.max_inflight <= 3


def test_compare_rejects_ragged_inputs():
    with LLMJudge(spec_for("http://127.0.0.1:9/v1")) as judge, pytest.raises(ValueError, match="equal lengths"):
        judge.compare(["p"], ["a", "b"], ["c"])
