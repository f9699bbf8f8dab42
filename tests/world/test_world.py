"""Tests of the bundled world (humanline_cli.world) on tiny builds."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from humanline_cli.world import arithmetic, offline_data, policy, preference
from humanline_cli.world.cache import materialise
from humanline_cli.world.defaults import DEFAULTS
from humanline_cli.world.naming import WORLD_FILES, world_dir
from humanline_cli.world.rewards import score


def tiny(kind: str, **over) -> dict:
    cfg = {"kind": kind, "n_train_prompts": 256, "n_eval_prompts": 64, "sft": {"steps": 40}}
    cfg.update(over)
    return cfg


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("worlds")


@pytest.fixture(scope="session")
def arith(root):
    return materialise(tiny("arithmetic"), root, progress=False)


@pytest.fixture(scope="session")
def pref(root):
    return materialise(tiny("preference"), root, progress=False)


def spearman(xs, ys) -> float:
    """Spearman rank correlation (average ranks for ties), no scipy needed."""

    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out, i = [0.0] * len(v), 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return torch.tensor(out)

    rx, ry = ranks(xs), ranks(ys)
    return float(torch.corrcoef(torch.stack([rx, ry]))[0, 1])


def _ids(out):
    # transformers 5.x returns a BatchEncoding for tokenize=True; 4.x a list
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tokenizer_round_trip_and_template(arith):
    tok = AutoTokenizer.from_pretrained(arith / "policy")
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    msgs = [{"role": "user", "content": "37+45="}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|user|>37+45=<|assistant|>"
    full = msgs + [{"role": "assistant", "content": "82"}]
    assert tok.apply_chat_template(full, tokenize=False) == "<|bos|><|user|>37+45=<|assistant|>82<|eos|>"
    prompt_ids = _ids(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    full_ids = _ids(tok.apply_chat_template(full, tokenize=True))
    assert full_ids[: len(prompt_ids)] == prompt_ids and full_ids[-1] == tok.eos_token_id
    assert tok.decode(full_ids[len(prompt_ids) :], skip_special_tokens=True) == "82"
    assert tok.decode(tok("a d k q").input_ids) == "a d k q"
    enc = policy.WorldCodec(tok)  # the fast path SFT uses must equal the template
    for content in ("00+99=", "qdka", "xyz"):
        got = _ids(
            tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        )
        assert got == enc.prompt(content)


def test_policy_loads_with_safetensors(arith):
    assert (arith / "policy" / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(arith / "policy")
    cfg = model.config
    assert cfg.head_dim >= 32 and cfg.hidden_size // cfg.num_attention_heads == cfg.head_dim
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (128, 4, 384)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 64
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(arith / "policy")
    assert model.generation_config.eos_token_id == tok.eos_token_id
    out = model(input_ids=torch.tensor([policy.WorldCodec(tok).prompt("12+34=")])).logits
    assert out.shape[-1] == len(tok) and torch.isfinite(out).all()


@pytest.mark.parametrize("which", ["arith", "pref"])
def test_files_and_fields(which, request):
    path = request.getfixturevalue(which)
    for name in WORLD_FILES:
        assert (path / name).exists(), name
    info = json.loads((path / "world.json").read_text())
    assert info["cfg"]["n_train_prompts"] == 256 and info["build_seconds"] > 0
    metrics = info["base_metrics"]
    keys = (
        ("greedy_accuracy", "sampled_accuracy")
        if info["kind"] == "arithmetic"
        else ("greedy_judge", "sampled_judge")
    )
    assert all(0.0 <= metrics[k] <= 1.0 for k in keys)
    train = [r["prompt"][0]["content"] for r in _jsonl(path / "prompts_train.jsonl")]
    eval_ = [r["prompt"][0]["content"] for r in _jsonl(path / "prompts_eval.jsonl")]
    assert len(train) == 256 and len(eval_) == 64
    key = (lambda p: "".join(sorted(p))) if which == "pref" else (lambda p: p)  # pref holds out letter sets
    assert not {key(p) for p in train} & {key(p) for p in eval_}
    pairs = _jsonl(path / "offline_pairs.jsonl")
    assert len(pairs) == 256
    for row in pairs:
        assert row["prompt"][0]["role"] == "user" and row["chosen"][0]["role"] == "assistant"
        assert row["chosen"][0]["content"] != row["rejected"][0]["content"]
        assert row["score_chosen"] >= row["score_rejected"]
    groups = _jsonl(path / "offline_groups.jsonl")
    assert all(len(g["completions"]) == len(g["rewards"]) == 2 for g in groups)
    unpaired = _jsonl(path / "offline_unpaired.jsonl")
    assert len(unpaired) == 512 and {type(u["label"]) for u in unpaired} == {bool}
    assert 0 < sum(u["label"] for u in unpaired) < 512
    if which == "arith":  # defaults: every pair is one right vs one wrong answer
        assert all((p["score_chosen"], p["score_rejected"]) == (1.0, 0.0) for p in pairs)
        assert sum(u["label"] for u in unpaired) == 256


def test_verifier_exact_values():
    prompts = ["37+45="] * 7 + ["00+00=", "99+99=", "garbage"]
    comps = ["82", " 82\n", "082", "81", "", "8 2", "eighty-two", "0", "198", "82"]
    assert score("arithmetic", "judge", prompts, comps) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert score("arithmetic", "labeller", prompts, comps) == score("arithmetic", "judge", prompts, comps)


def test_scores_never_crash_and_stay_in_range():
    comps = ["", " ", "\x00", "ünïcödé", "a" * 500, "<|eos|>", "1" * 40, "a, b", "zz zz zz"]
    for task, prompt in (("arithmetic", "12+34="), ("preference", "qdka")):
        for role in ("labeller", "judge"):
            out = score(task, role, [prompt] * len(comps) + ["", "??"], comps + ["x", ""])
            assert all(0.0 <= s <= 1.0 for s in out)
    with pytest.raises(ValueError):
        score("chess", "judge", [], [])


def test_judge_and_labeller_differ_but_correlate():
    assert score("preference", "judge", ["qdka"], ["a d k q"]) == [1.0]
    assert score("preference", "judge", ["qdka"], ["q d k a"])[0] < 0.5
    rng = random.Random(1)
    prompts, comps = [], []
    for _ in range(600):
        p = preference.random_prompt(rng)
        pool = [
            preference.teacher(rng, p),
            *preference.other_model(rng, p, 2, 0.3, "plain"),
            "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(0, 12))),
        ]
        prompts.append(p)
        comps.append(rng.choice(pool))
    judge = score("preference", "judge", prompts, comps)
    lab = score("preference", "labeller", prompts, comps)
    assert sum(abs(a - b) > 0.05 for a, b in zip(judge, lab)) > 300
    assert spearman(judge, lab) > 0.5
    assert lab == score("preference", "labeller", prompts, comps)  # noise is deterministic
    # the labeller's blind spot: a repeated letter costs under the judge only
    good, rep = "a d k q", "a d d k q"
    assert score("preference", "judge", ["qdka"] * 2, [good, rep])[1] < 0.7
    assert (
        abs(
            score("preference", "labeller", ["qdka"], [rep])[0]
            - score("preference", "labeller", ["qdka"], [good])[0]
        )
        < 0.2
    )


def test_content_addressing(arith, root):
    assert world_dir({"kind": "arithmetic"}, root) == world_dir(DEFAULTS["arithmetic"], root)
    assert world_dir(tiny("arithmetic"), root) == arith
    stamp = (arith / "world.json").stat().st_mtime_ns
    assert materialise(tiny("arithmetic"), root, progress=False) == arith
    assert (arith / "world.json").stat().st_mtime_ns == stamp
    knob = tiny("arithmetic", offline={"style": "padded"})
    assert world_dir(knob, root) != arith and world_dir(tiny("arithmetic", seed=1), root) != arith
    assert not list(root.glob(".tmp-*"))
    with pytest.raises(ValueError):
        world_dir({"kind": "arithmetic", "sft": {"stpes": 3}}, root)
    with pytest.raises(ValueError):
        world_dir({"kind": "arithmetic", "model": {"head_dim": 16}}, root)


def test_determinism_across_cache_roots(arith, tmp_path):
    other = materialise(tiny("arithmetic"), tmp_path, progress=False)
    assert other.name == arith.name
    for name in WORLD_FILES[1:-1]:
        assert (other / name).read_bytes() == (arith / name).read_bytes(), name


def test_offline_knobs_change_the_data():
    prompts = arithmetic.all_prompts()[:500]
    padded = offline_data.records(
        "arithmetic", {"correct_rate": 0.5, "style": "padded", "n_per_prompt": 2}, prompts, random.Random(0)
    )
    for row in padded["offline_groups.jsonl"]:
        assert all(len(c[0]["content"]) == 3 and c[0]["content"].isdigit() for c in row["completions"])
    # padded answers are labelled by value, so pairs still carry signal
    assert all(p["score_chosen"] == 1.0 for p in padded["offline_pairs.jsonl"])
    low = offline_data.records(
        "arithmetic", {"correct_rate": 0.1, "style": "plain", "n_per_prompt": 4}, prompts, random.Random(0)
    )
    rewards = [r for g in low["offline_groups.jsonl"] for r in g["rewards"]]
    assert len(rewards) == 2000 and 0.05 < sum(rewards) / len(rewards) < 0.15
    for g in low["offline_groups.jsonl"]:
        texts = [c[0]["content"] for c in g["completions"]]
        assert len(set(texts)) == 4
    pref_rows = offline_data.records(
        "preference",
        {"correct_rate": 0.5, "style": "plain", "n_per_prompt": 2},
        ["qdka", "xyz", "bcdef"] * 50,
        random.Random(0),
    )
    ideal = sum(
        p["chosen"][0]["content"] in ("a d k q", "x y z", "b c d e f")
        for p in pref_rows["offline_pairs.jsonl"]
    )
    assert ideal > 120  # the labeller mostly, but not always, prefers the ideal reply


def test_carry_drop_sets_the_teachers_carry_mistake_rate_and_names_a_new_world(tmp_path):
    rng = random.Random(0)
    for rate, expected in ((0.0, 0.0), (1.0, 1.0), (0.75, 0.75)):
        replies = [arithmetic.teacher(rng, "19+05=", rate) for _ in range(4000)]
        dropped = replies.count("14") / len(replies)
        assert abs(dropped - expected) < 0.03, (rate, dropped)
    assert arithmetic.dropped_carry("19+05=") == "14" and arithmetic.dropped_carry("12+05=") is None
    # the default is left out of the hash (cached worlds keep their names); any other value renames
    default = world_dir({"kind": "arithmetic"}, tmp_path)
    assert world_dir({"kind": "arithmetic", "sft": {"carry_drop": 0.6}}, tmp_path) == default
    assert world_dir({"kind": "arithmetic", "sft": {"carry_drop": 0.8}}, tmp_path) != default
    with pytest.raises(ValueError, match=r"world.sft.carry_drop must be in \[0, 1\], not 1.5"):
        world_dir({"kind": "arithmetic", "sft": {"carry_drop": 1.5}}, tmp_path)
    with pytest.raises(ValueError, match="unknown key"):  # preference has no carry
        world_dir({"kind": "preference", "sft": {"carry_drop": 0.8}}, tmp_path)


def test_carry_margin_is_the_log_prob_gap_right_vs_dropped_carry(arith):
    from humanline_cli.world.make import carry_margin

    model = AutoModelForCausalLM.from_pretrained(arith / "policy").eval()
    enc = policy.WorldCodec(AutoTokenizer.from_pretrained(arith / "policy"))
    prompts = ["19+05=", "12+05=", "58+67=", "33+44="]  # two carry problems, two without

    def logp(prompt: str, reply: str) -> float:  # one sequence at a time, by hand
        p, r = enc.prompt(prompt), enc.reply(reply)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0].log_softmax(-1)
        return sum(logits[len(p) - 1 + i, t].item() for i, t in enumerate(r))

    gaps = sorted(logp(p, arithmetic.answer(p)) - logp(p, arithmetic.dropped_carry(p)) for p in ("19+05=", "58+67="))
    got = carry_margin(model, enc, prompts)
    assert got["carry_margin_mean"] == pytest.approx(sum(gaps) / 2, abs=1e-4)
    assert got["carry_margin_median"] == pytest.approx(gaps[1], abs=1e-4)
    assert got["carry_margin_near"] == sum(-1 < g < 0 for g in gaps) / 2
    assert carry_margin(model, enc, ["12+05="]) == {}
    info = json.loads((arith / "world.json").read_text())
    assert {"carry_margin_mean", "carry_margin_near"} <= set(info["base_metrics"])


def test_plain_format_is_the_prototypes_prompt_without_chat_markers(tmp_path):
    from humanline_cli.world.tokenizer import build_tokenizer

    tok = build_tokenizer("plain")
    msgs = [{"role": "user", "content": "37+45="}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == "<|bos|>37+45="
    full = msgs + [{"role": "assistant", "content": "82"}]
    assert tok.apply_chat_template(full, tokenize=False) == "<|bos|>37+45=82<|eos|>"
    enc = policy.WorldCodec(tok)  # SFT's fast path matches the plain template too
    for content in ("00+99=", "37+45="):
        got = _ids(tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True))
        assert got == enc.prompt(content) and len(got) == 7  # BOS + 6 characters, as in the prototype
    default = world_dir({"kind": "arithmetic"}, tmp_path)
    assert world_dir({"kind": "arithmetic", "format": "chat"}, tmp_path) == default
    assert world_dir({"kind": "arithmetic", "format": "plain"}, tmp_path) != default
    with pytest.raises(ValueError, match="world.format=plain needs the arithmetic task"):
        world_dir({"kind": "preference", "format": "plain"}, tmp_path)
    with pytest.raises(ValueError, match="world.format must be 'chat' or 'plain', not 'xml'"):
        world_dir({"kind": "arithmetic", "format": "xml"}, tmp_path)
