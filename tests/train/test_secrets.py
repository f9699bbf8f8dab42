"""Secret key names and scrubbing (tracking.py): which config keys count as secrets, and masking them in
values, overrides, argv and saved configs. The end-to-end check that a run writes no secret anywhere is
test_bad_input.py's test_secrets_are_masked_in_every_file_a_run_writes."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from humanline_cli.train.tracking import is_secret_key, mask_saved_configs, scrub, scrub_argv, scrub_override

SECRET = "SECRETVALUE123"


@pytest.mark.parametrize("name", ["api_key", "apiKey", "APIKey", "apikey", "hf_token", "HF_TOKEN", "token",
                                  "access_token", "password", "db_password", "passwd", "client_secret", "secret",
                                  "key", "secret_access_key", "wandb.api_key", "task.judge.api_key", "credentials"])
def test_secret_key_names(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ["max_new_tokens", "eval.max_new_tokens", "tokenizer", "model.tokenizer", "tokens",
                                  "api_key_env", "eos_token", "pad_token", "sort_key", "private_key_path", "keys",
                                  "monkey", "token_budget", "name_or_path", "secretary"])
def test_harmless_key_names(name):
    assert not is_secret_key(name)


def test_scrub_masks_by_key_name_only():
    cfg = {"wandb": {"api_key": "abc", "project": "p"}, "eval": {"max_new_tokens": 16},
           "model": {"tokenizer": "t", "name_or_path": "m"}, "judge": {"api_key_env": "OPENAI_API_KEY", "token": None},
           "list": [{"password": "pw"}, "token=xyz"]}
    assert scrub(cfg) == {"wandb": {"api_key": "***", "project": "p"}, "eval": {"max_new_tokens": 16},
                          "model": {"tokenizer": "t", "name_or_path": "m"},
                          "judge": {"api_key_env": "OPENAI_API_KEY", "token": None},
                          "list": [{"password": "***"}, "token=xyz"]}  # plain strings are values, left alone
    assert cfg["wandb"]["api_key"] == "abc"  # a copy: the config itself is not mutated


def test_scrub_overrides_and_argv():
    assert scrub_argv(["humanline train", "+wandb.api_key=abc", "eval.max_new_tokens=7", "~hf_token=x",
                       "+x.token=a,b", "model.tokenizer=t", "-m"]) == [
        "humanline train", "+wandb.api_key=***", "eval.max_new_tokens=7", "~hf_token=***", "+x.token=***",
        "model.tokenizer=t", "-m"]
    assert scrub_override("+task.judge.api_key=S1,+task.labeller.hf_token=S2,eval.max_new_tokens=7,threads=1") == (
        "+task.judge.api_key=***,+task.labeller.hf_token=***,eval.max_new_tokens=7,threads=1")
    assert scrub_override("model.password=") == "model.password="  # nothing to hide


def test_mask_saved_configs_rewrites_only_files_with_secrets(tmp_path):
    sub = tmp_path / ".hydra"
    sub.mkdir()
    (sub / "config.yaml").write_text("eval:\n  max_new_tokens: 7\ntask:\n  judge:\n    api_key: S1\n"
                                     "x: ${eval.max_new_tokens}\n")
    (sub / "overrides.yaml").write_text("- +task.judge.api_key=S1\n- eval.max_new_tokens=7\n")
    clean = "- threads=1\n"
    (sub / "clean.yaml").write_text(clean)
    changed = mask_saved_configs([sub / "config.yaml", sub / "overrides.yaml", sub / "clean.yaml", sub / "absent.yaml"])
    assert changed == [sub / "config.yaml", sub / "overrides.yaml"]
    cfg = OmegaConf.load(sub / "config.yaml")
    assert cfg.task.judge.api_key == "***" and cfg.eval.max_new_tokens == 7
    assert OmegaConf.to_container(cfg)["x"] == "${eval.max_new_tokens}"  # interpolations kept as written
    assert OmegaConf.to_container(OmegaConf.load(sub / "overrides.yaml")) == ["+task.judge.api_key=***",
                                                                               "eval.max_new_tokens=7"]
    assert (sub / "clean.yaml").read_text() == clean
    assert sorted(p.name for p in sub.iterdir()) == ["clean.yaml", "config.yaml", "overrides.yaml"]  # no temp files


@pytest.mark.parametrize("text,masked", [
    ("https://user:S3CRETVALUE@host/v1", "https://user:***@host/v1"),
    ("postgres://u:S3CRET@db:5432/app", "postgres://u:***@db:5432/app"),
    ("https://ghp_aBcdEfGhijKlmnOpqrStuvWxyz0123456789@github.com/o/r", "https://***@github.com/o/r"),
    ("token github_pat_11ABCDEFG0123456789_abcdefghijkl here", "token *** here"),
    ("sk-proj-aBcDeFgHiJkLmNoPqRsTuV-w1x2y3z4", "***"), ("hf_AbCdEfGhIjKlMnOpQrStUvWxYzAbCdEfGh", "***"),
    ("xoxb-123456789012-AbCdEfGhIjKl", "***"), ("AKIAIOSFODNN7EXAMPLE", "***"),
    # what looks alike and is not a credential stays
    ("http://localhost:8000/v1", "http://localhost:8000/v1"), ("world://policy", "world://policy"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"), ("ask-me-anything", "ask-me-anything"),
    ("hf_short", "hf_short"), ("user@host.example:22", "user@host.example:22"),
    ("/data/sk-learn-runs-2024-final.jsonl", "/data/sk-learn-runs-2024-final.jsonl"),  # one case: a name
    ("hf_arithmeticpairsversiontwo", "hf_arithmeticpairsversiontwo"),
])
def test_secrets_are_masked_by_their_shape(text, masked):
    from humanline_cli.errors import mask_secrets

    assert mask_secrets(text) == masked


def test_value_shapes_are_masked_in_configs_overrides_argv_summaries_and_error_lines():
    from humanline_cli.errors import one_line
    from humanline_cli.train.tracking import mask_values

    cfg = {"judge": {"base_url": "https://user:S3CRETVALUE@host/v1", "model": "gpt"}, "GITHUB_PAT": "plainvalue",
           "env": ["DATABASE_URL=postgres://u:S3CRETVALUE@db/x"]}
    assert scrub(cfg) == {"judge": {"base_url": "https://user:***@host/v1", "model": "gpt"}, "GITHUB_PAT": "***",
                          "env": ["DATABASE_URL=postgres://u:***@db/x"]}
    assert scrub_argv(["judge.base_url=https://user:S3CRETVALUE@host", "+hydra.job.env_set.GITHUB_PAT=abc",
                       "https://user:S3CRETVALUE@host"]) == [
        "judge.base_url=https://user:***@host", "+hydra.job.env_set.GITHUB_PAT=***", "https://user:***@host"]
    assert mask_values({"judge": "llm/https://u:S3CRETVALUE@h", "tokens": 5, "eval": {"key": "k"}}) == {
        "judge": "llm/https://u:***@h", "tokens": 5, "eval": {"key": "k"}}  # a summary's names are not config keys
    assert one_line(ConnectionError("cannot reach https://u:S3CRETVALUE@h:\n refused")) == (
        "cannot reach https://u:***@h: refused")
