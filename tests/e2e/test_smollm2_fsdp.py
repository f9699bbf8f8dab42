"""SmolLM2-135M-Instruct (model=smollm2) on 2 gloo ranks under FSDP2: offline DPO with humanline on hand-written
pairs (the right sum vs one off by ten), one step, evaluated on both ranks' shares; the saved model holds the
tied embedding once (full fine-tuning moved it) and reloads tied."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from tests.helpers.cli import SMOLLM2, TIMEOUT, run_cli


def test_fsdp_two_ranks_dpo_humanline_keeps_tied_embeddings(smollm2, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [(27, 82), (45, 38), (19, 64), (73, 18)]
    pairs.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}",
                                         "rejected": f"{a} + {b} = {a + b - 10}"}) + "\n" for a, b in rows))
    run = tmp_path / "run"
    r = run_cli(["train", *SMOLLM2, "threads=1", "backend=cpu", "backend.strategy=fsdp", "backend.nproc=2",
                 "objective=dpo", "+humanline=true", f"data.path={pairs}", "train.steps=1", "train.batch_size=2",
                 "train.lr=1e-4", f"hydra.run.dir={run}"], tmp_path, timeout=2 * TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "complete" and s["humanline"] is True and s["eval"]["n_prompts"] == 4
    saved = load_file(str(run / "model" / "model.safetensors"))
    start = load_file(str(smollm2 / "model.safetensors"))
    # the FSDP full-state gather returns the tied tensor under both names, as two copies; the save writes it once, as
    # a single-process save_pretrained does, and loading the folder ties the head to it again
    assert saved.keys() == start.keys() and "lm_head.weight" not in saved
    from humanline_cli.models import load_policy

    back = load_policy(str(run / "model"), torch.device("cpu"))
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert all(torch.equal(v, saved[k]) for k, v in back.state_dict().items() if k != "lm_head.weight")
    assert json.loads((run / "model" / "config.json").read_text())["tie_word_embeddings"] is True
    moved = (saved["model.embed_tokens.weight"].float() - start["model.embed_tokens.weight"]).abs().max()
    assert moved > 0  # the shared tensor trained (input and output roles) and was gathered from both shards
    assert torch.isfinite(saved["model.norm.weight"]).all()
