"""LoRA under FSDP2: the peft model (frozen base weights and adapters) sharded layer by layer on 2 gloo
ranks trains exactly as one process does, and its merged weights (what the vLLM push streams and what
the run saves) are gathered from the shards layer by layer and equal the unsharded merge."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.helpers.cli import FAST, TINY_WORLD, run_cli
from tests.helpers.models import tiny_llama
from tests.helpers.numerics import FP64, PADDED, SAVED_REL, assert_same_rows, max_weight_diff

ADAPTER = Path("model") / "adapter" / "policy" / "adapter_model.safetensors"


def _lora_model():
    """A tiny float64 Llama with r=4 adapters whose B is random (peft starts B at 0: a merge would be
    the base weights alone), the same on every rank."""
    from humanline_cli.core.lora import apply_lora

    model = apply_lora(tiny_llama(0, tie_word_embeddings=True).double(), r=4, alpha=8, dropout=0.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return model


def _merge_rank(rank: int, port: int, result: dict) -> None:
    import os

    import torch.distributed as tdist

    from humanline_cli.backend import shard_model
    from humanline_cli.core.lora import merged_state_dict, merged_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        model = _lora_model()
        whole = {k: v.clone() for k, v in merged_state_dict(model).items()}  # before sharding: peft's own delta
        shard_model(model)
        sharded = [p for p in model.parameters() if hasattr(p, "full_tensor")]
        got = list(merged_weights(model))  # every rank consumes it: the gathers are collectives
        result[rank] = (len(sharded), [k for k, _ in got], whole.keys() == {k for k, _ in got},
                        max(float((whole[k] - v).abs().max()) for k, v in got),
                        all(not hasattr(v, "full_tensor") for _, v in got))
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
def test_merged_weights_gathered_from_fsdp_shards_equal_the_unsharded_merge():
    """What the vLLM push streams from a LoRA policy under FSDP2: every base weight gathered with its
    adapter's A and B, merged as peft merges (base + B A alpha / r), equal to the unsharded merge to
    1e-12 (float64; only the matmul's summation order may differ), on both ranks, as plain tensors."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = mp.Manager().dict()
    mp.spawn(_merge_rank, args=(port, result), nprocs=2, join=True)
    for rank in (0, 1):
        n_sharded, keys, same_keys, worst, plain = result[rank]
        assert n_sharded > 0 and same_keys and plain  # really sharded; every merged entry, gathered
        assert "model.layers.0.self_attn.q_proj.weight" in keys and not any("lora_" in k for k in keys)
        assert worst < 1e-12


def _train(tmp_path: Path, name: str, extra: list[str]):
    out = tmp_path / name
    r = run_cli(["train", *TINY_WORLD, *FAST, "backend=cpu", "train.length_bucketing=false", f"hydra.run.dir={out}",
                 *extra], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, load_file(str(out / "model" / "model.safetensors")), load_file(str(out / ADAPTER))


@pytest.mark.slow
def test_lora_on_two_fsdp_ranks_matches_one_process(tmp_path, cache_dir):
    """DPO + humanline with r=4 adapters (the reference: a second, synced adapter on the same sharded
    base), float64: 2 FSDP ranks vs 1 process give the same per-step loss and gradient norm (relative
    1e-9), the same saved adapter (1e-12: float64, saved as trained) and the same merged model (one
    float32 ulp: saved in float32). The 2-rank run also writes a sharded checkpoint at step 2."""
    common = ["objective=dpo", "+humanline=true", "model.lora.r=4", *FP64, *PADDED]
    one_rows, one, one_adapter = _train(tmp_path, "one", common)
    two_rows, two, two_adapter = _train(tmp_path, "two", [*common, "backend.strategy=fsdp", "backend.nproc=2",
                                                          "train.checkpoint_every=2"])
    assert [r["units"] for r in two_rows] == [r["units"] for r in one_rows] == [8, 8, 8]
    assert_same_rows(one_rows, two_rows)
    assert one_adapter.keys() == two_adapter.keys() and len(one_adapter) > 0
    assert max(float((one_adapter[k] - two_adapter[k]).abs().max()) for k in one_adapter) < 1e-12
    assert max_weight_diff(one, two) <= SAVED_REL  # the merged model, gathered from the shards on rank 0
    start = load_file(str(next(cache_dir.glob("arithmetic-*")) / "policy" / "model.safetensors"))
    assert max_weight_diff({k: one[k] for k in start}, start) > 1e-5  # the adapters really trained
    assert (tmp_path / "two" / "checkpoints" / "step_2" / "shards" / ".metadata").is_file()
