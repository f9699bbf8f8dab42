"""A hub id (what the paper configs name) is loaded sharded from its snapshot in the huggingface_hub cache,
as a local folder is, and the memory estimate takes the same loading mode. A fake hub cache holds a tiny
model (huggingface_hub's layout: models--ORG--NAME/{refs/main, snapshots/COMMIT/...}); nothing is
downloaded (HF_HUB_OFFLINE=1)."""
from __future__ import annotations

import torch

from tests.helpers.models import tiny_llama

REPO = "tiny-org/tiny-llama"
BIN = "tiny-org/tiny-llama-bin"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _fake_hub(tmp_path, monkeypatch, repo_id: str = REPO, safetensors: bool = True):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    model = tiny_llama(0, hidden_size=16, intermediate_size=32, max_position_embeddings=32)
    snapshot = repo / "snapshots" / COMMIT
    model.save_pretrained(snapshot)
    if not safetensors:  # an older repo: the weights as pytorch_model.bin
        from safetensors.torch import load_file

        torch.save(load_file(snapshot / "model.safetensors"), snapshot / "pytorch_model.bin")
        (snapshot / "model.safetensors").unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return model, snapshot


def test_a_hub_id_is_loaded_sharded_from_its_cached_snapshot(tmp_path, monkeypatch):
    from humanline_cli.train.sharded_load import load_policy_sharded, local_model_dir, sharded_loadable

    model, snapshot = _fake_hub(tmp_path, monkeypatch)
    assert local_model_dir(REPO) == str(snapshot)
    assert sharded_loadable(REPO) and not sharded_loadable("tiny-org/not-cached")
    sharded = []  # one process: the shard step is recorded, the whole tensors are read
    policy = load_policy_sharded(REPO, torch.device("cpu"), torch.float64, lambda m: sharded.append(type(m).__name__))
    assert sharded == ["LlamaForCausalLM"] and policy is not None
    want = model.state_dict()
    got = policy.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name].double()), name


def test_the_memory_estimate_takes_the_loading_mode_build_parts_takes(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve
    from humanline_cli.memory import estimate
    from humanline_cli.train.fit import memory_estimate

    _fake_hub(tmp_path, monkeypatch)
    _fake_hub(tmp_path, monkeypatch, BIN, safetensors=False)  # no safetensors: sharded loading cannot read it
    common = ["task=custom", "data.path=unused.jsonl", "backend=cpu", "backend.strategy=fsdp", "backend.nproc=2",
              "train.max_length=32", "train.max_prompt_length=16", "chat_template=false", "judge=none"]
    with initialize_config_module(config_module="conf", version_base="1.3"):
        spec = resolve(compose("train", overrides=[*common, f"model.name_or_path={REPO}"]))
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(REPO)
    est = memory_estimate(spec, REPO, torch.device("cpu"))
    kw = dict(seqs_per_micro=2 * spec.train.micro_batch_size, max_length=32, lora_r=0,
              moving_reference=False, strategy="fsdp", ranks=2, gradient_checkpointing=False)
    sharded, full = estimate(config, loading="sharded", **kw), estimate(config, loading="full", **kw)
    assert full.loading > sharded.loading  # the two modes differ on this model
    assert est.loading == sharded.loading
    with initialize_config_module(config_module="conf", version_base="1.3"):
        spec = resolve(compose("train", overrides=[*common, f"model.name_or_path={BIN}"]))
    assert memory_estimate(spec, BIN, torch.device("cpu")).loading == full.loading  # loaded whole: estimated so


def test_a_first_run_fetches_the_snapshot_so_that_it_loads_sharded(tmp_path, monkeypatch):
    """Not cached yet: fetch_snapshot downloads the safetensors snapshot (here: a fake download that writes the
    fake cache's snapshot), after which the hub id loads sharded; a download that fails leaves the whole-model
    path, and a run whose whole load will not fit says what to run."""
    import shutil

    import huggingface_hub

    from humanline_cli.train.sharded_load import SNAPSHOT_FILES, fetch_snapshot, sharded_loadable

    _, snapshot = _fake_hub(tmp_path, monkeypatch)
    kept = tmp_path / "kept"
    shutil.move(str(snapshot), kept)  # the cache holds nothing of the model now
    assert not sharded_loadable(REPO)
    asked = []

    def download(repo_id, allow_patterns=None, **kw):
        asked.append((repo_id, allow_patterns, kw.get("local_files_only", False)))
        if kw.get("local_files_only"):
            if not snapshot.is_dir():
                raise FileNotFoundError(repo_id)
            return str(snapshot)
        shutil.copytree(kept, snapshot)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert fetch_snapshot(REPO) == str(snapshot) and sharded_loadable(REPO)
    downloads = [a for a in asked if not a[2]]
    assert downloads == [(REPO, SNAPSHOT_FILES, False)]  # weights as safetensors only: never a pickle
    assert fetch_snapshot(REPO) == str(snapshot) and [a for a in asked if not a[2]] == downloads  # cached: no download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    assert fetch_snapshot("tiny-org/elsewhere") is None and fetch_snapshot("./not-a-hub-id") is None


def test_a_whole_load_that_will_not_fit_says_to_fetch_the_model(tmp_path, monkeypatch):
    import pytest
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve
    from humanline_cli.errors import UserError
    from humanline_cli.train import fit

    _fake_hub(tmp_path, monkeypatch, BIN, safetensors=False)  # cached, but sharded loading cannot read it
    with initialize_config_module(config_module="conf", version_base="1.3"):
        spec = resolve(compose("train", overrides=[
            "task=custom", "data.path=unused.jsonl", "backend=cpu", "backend.strategy=fsdp", "backend.nproc=2",
            "train.max_length=32", "train.max_prompt_length=16", "chat_template=false", "judge=none",
            f"model.name_or_path={BIN}"]))
    import dataclasses

    real = fit._estimator
    whole = 10 * fit.memory_estimate(spec, BIN, torch.device("cpu")).training
    # at 8B loading whole is the peak (59.8 GiB before sharding); this tiny model's is its activations: raise it
    monkeypatch.setattr(fit, "_estimator",
                        lambda *a, **k: lambda m, f=real(*a, **k): dataclasses.replace(f(m), loading=whole))
    est = fit.memory_estimate(spec, BIN, torch.device("cpu"))
    assert est.loading == whole > est.training
    host = (est.training + est.loading) / 2 / 0.9 * fit.CPU_RSS_OVER_LIVE  # training fits, loading does not
    monkeypatch.setattr(fit, "host_available_bytes", lambda: host)
    with pytest.raises(UserError) as e:
        fit.fit_memory(spec, BIN, torch.device("cpu"))
    assert "\n" not in str(e.value) and str(e.value).endswith(
        f"fetch it first (hf download {BIN}) and rerun, and it loads sharded")


def test_every_node_fetches_the_snapshot_once(monkeypatch):
    """Two nodes of 8 ranks with node-local huggingface_hub caches: each node's local rank 0 fetches the hub id's
    snapshot (rank 0 first), so that no node finds it missing and loads the whole model on every rank; every rank
    meets the same two barriers (around rank 0's preparation, after each node's fetch)."""
    from hydra import compose, initialize_config_module

    from humanline_cli.backend import Dist
    from humanline_cli.config import resolve
    from humanline_cli.train import build
    from humanline_cli.train.timing import PhaseTimer

    fetched, waits = [], []
    monkeypatch.setattr(build, "fetch_snapshot", lambda path: fetched.append(path))
    monkeypatch.setattr(build, "wait_for_rank0", lambda: waits.append(len(fetched)))
    with initialize_config_module(config_module="conf", version_base="1.3"):
        spec = resolve(compose("train", overrides=["task=custom", "data.path=unused.jsonl", "backend=cuda",
                                                   "backend.strategy=fsdp", "backend.nproc=8",
                                                   f"model.name_or_path={REPO}"]))
    for rank, local in ((0, 0), (1, 1), (8, 0), (15, 7)):
        fetched.clear()
        waits.clear()
        build.prepare_files(spec, Dist(rank, 16, local), PhaseTimer())
        assert fetched == ([REPO] if local == 0 else []), rank
        assert len(waits) == 2, rank
    assert waits == [0, 0]  # rank 15: waits for rank 0, fetches nothing, waits for the other nodes' fetches
