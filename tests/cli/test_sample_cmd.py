"""`humanline sample`: an offline dataset from a model's own samples, scored by the task's labeller,
in TRL formats (groups with rewards, pairs best vs worst with scores, unpaired for KTO) with a card; the same
completions whatever the chunking (determinism), and a crashed run resumed by the same command."""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

from humanline_cli.cli.sample import derived_rows, labeller_text
from humanline_cli.world.rewards import score
from tests.helpers.cli import FAST, TINY_WORLD, run_cli

ARGS = ["sample", *TINY_WORLD, "data.n=4", "data.limit=20", "threads=1"]


def _jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_pairs_and_unpaired_from_a_group_hand_computed():
    pair, unpaired = derived_rows({"prompt": "q", "completions": ["a", "b", "c", "d"], "rewards": [0.0, 1.0, 1.0, 0.5]})
    # best: the first of the top score (b); worst: the first lowest other than it (a); mean 0.625
    assert pair == {"prompt": "q", "chosen": "b", "rejected": "a", "score_chosen": 1.0, "score_rejected": 0.0}
    assert [u["label"] for u in unpaired] == [False, True, True, False]
    chat = [{"role": "user", "content": "q"}]
    reply = [{"role": "assistant", "content": "x"}]
    pair, unpaired = derived_rows({"prompt": chat, "completions": [reply, reply], "rewards": [0.0, 0.0]})
    assert (pair["chosen"], pair["rejected"], pair["score_chosen"]) == (reply, reply, 0.0)
    assert [u["label"] for u in unpaired] == [False, False]  # all tied: desirable iff score >= 0.5


def test_the_card_names_a_world_scorers_role():
    def spec(kind, role, reward="task"):
        labeller = SimpleNamespace(kind=kind, name_or_path=None, task="arithmetic", role=role)
        return SimpleNamespace(reward_cfg=SimpleNamespace(kind=reward), task_cfg=SimpleNamespace(labeller=labeller))

    assert labeller_text(spec("world", "judge")) == "task.labeller: world arithmetic/judge"
    assert labeller_text(spec("world", "labeller")) == "task.labeller: world arithmetic/labeller"
    assert labeller_text(spec("world", "judge", reward="model")) == "reward=model"


def test_sample_formats_determinism_resume_and_training_on_it(cache_dir, tmp_path):
    a = tmp_path / "a"
    r = run_cli([*ARGS, f"out={a}", "chunk=8"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "humanline sample: 20 prompts x 4 samples" in r.stdout and "sample: 100%" in r.stderr  # the progress bar
    groups, pairs, unpaired = _jsonl(a / "groups.jsonl"), _jsonl(a / "pairs.jsonl"), _jsonl(a / "unpaired.jsonl")
    train = _jsonl(next(cache_dir.glob("arithmetic-*")) / "prompts_train.jsonl")[:20]
    assert [g["prompt"] for g in groups] == [t["prompt"] for t in train] and len(unpaired) == 80
    for g, p in zip(groups, pairs):
        texts = [c[0]["content"] for c in g["completions"]]  # chat prompts: assistant messages
        assert g["rewards"] == score("arithmetic", "labeller", [g["prompt"][0]["content"]] * 4, texts)
        assert (p["score_chosen"], p["score_rejected"]) == (max(g["rewards"]), min(g["rewards"]))
    c = json.loads((a / "card.json").read_text())
    assert c["model"] == "world://policy" and c["labeller"] == "task.labeller: world arithmetic/labeller"
    assert c["sampling"] == {"sampler": "hf", "n": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16,
                             "seed": 0}
    scores = [s for g in groups for s in g["rewards"]]
    assert c["counts"]["prompts"] == 20 and c["counts"]["samples"] == 80
    assert c["scores"]["mean"] == sum(scores) / 80 and c["scores"]["max"] == max(scores)
    # determinism: other chunks, same completions
    b = tmp_path / "b"
    assert run_cli([*ARGS, f"out={b}", "chunk=5"], tmp_path).returncode == 0
    assert (b / "groups.jsonl").read_text() == (a / "groups.jsonl").read_text()
    # resume: a run killed mid-write (7 complete prompts and half a line, no derived files) finishes the same
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(a / "sampling.json", d / "sampling.json")
    lines = (a / "groups.jsonl").read_text().splitlines(keepends=True)
    (d / "groups.jsonl").write_text("".join(lines[:7]) + lines[7][:30])
    r = run_cli([*ARGS, f"out={d}", "chunk=8"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("groups.jsonl", "pairs.jsonl", "unpaired.jsonl", "card.json"):
        assert (d / name).read_text() == (a / name).read_text(), name
    # other settings into the same dir: one line, exit 2, nothing touched
    r = run_cli([*ARGS[:-2], "data.n=3", "threads=1", f"out={d}"], tmp_path)
    assert r.returncode == 2 and r.stderr.strip().startswith("humanline: error:") and "other settings" in r.stderr
    assert (d / "groups.jsonl").read_text() == (a / "groups.jsonl").read_text()
    # the groups train GRPO directly (data.path=)
    run = tmp_path / "run"
    r = run_cli(["train", *TINY_WORLD, *FAST, "objective=grpo", f"data.path={a / 'groups.jsonl'}",
                 "train.batch_size=4", "eval.n_prompts=8", f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["status"] == "complete"


def test_sample_asks_a_tempered_engine_for_tempered_logps(cache_dir, tmp_path, monkeypatch):
    # a vLLM engine started under objective.tempered_logps refuses any sampled request in the other mode, so
    # `humanline sample` must send the run's mode (the transformers sampler stands in for the engine here)
    from humanline_cli.cli.sample import _spec, run_sample
    from humanline_cli.train import samplers

    asked = []
    real = samplers.make_sampler

    def recording(*args, **kwargs):
        sampler = real(*args, **kwargs)
        generate = sampler.generate
        sampler.generate = lambda ids, params, indices=None: (asked.append(params), generate(ids, params, indices))[1]
        return sampler

    monkeypatch.setattr(samplers, "make_sampler", recording)
    spec = _spec([*TINY_WORLD, "objective=grpo", "objective.tempered_logps=true", "data.temperature=0.7",
                  "data.n=2", "data.limit=3", "data.max_new_tokens=4", "threads=1"])
    info = run_sample(spec, tmp_path / "out", chunk=8, progress=False)
    assert info["counts"] == {**info["counts"], "prompts": 3, "samples": 6}
    assert [(p.tempered_logps, p.temperature, p.n, p.max_new_tokens) for p in asked] == [(True, 0.7, 2, 4)]
