"""The FSDP2 weight push gathers in the engine's dtype: a bf16 engine's push casts each fp32 shard first and gathers
bf16 (half the bytes over the interconnect), and the engine gets the very bits it would have made itself by rounding
the fp32 tensor as it loads (round to nearest even, elementwise, so casting before or after the gather is the same).
2 gloo ranks on CPU; the engine's dtype read from the engine (a fake one here)."""
from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers.models import tiny_llama


def _push_rank(rank: int, port: int, result: dict) -> None:
    import os

    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor

    from humanline_cli.backend import shard_model
    from humanline_cli.sampling.vllm import policy_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        model = tiny_llama(0)
        whole = {k: v.detach().clone() for k, v in model.named_parameters()}
        shard_model(model)
        gathered: list = []
        full = DTensor.full_tensor

        def recording(self, *a, **k):  # the dtype each gather moves
            gathered.append(self.dtype)
            return full(self, *a, **k)

        DTensor.full_tensor = recording
        narrow = list(policy_weights(model, torch.bfloat16))
        n_narrow = len(gathered)
        wide = list(policy_weights(model))
        result[rank] = (
            gathered[:n_narrow], gathered[n_narrow:],
            all(torch.equal(v, whole[k].to(torch.bfloat16)) for k, v in narrow),
            all(torch.equal(v, whole[k]) for k, v in wide), [k for k, _ in narrow] == list(whole))
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks
def test_a_bf16_engines_fsdp_push_gathers_bf16_with_the_bits_the_engine_would_round_to():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = mp.Manager().dict()
    mp.spawn(_push_rank, args=(port, result), nprocs=2, join=True)
    for rank in (0, 1):
        narrow, wide, same_bits, same_fp32, names = result[rank]
        assert len(narrow) > 0 and set(narrow) == {torch.bfloat16}  # every gather moved bf16
        assert set(wide) == {torch.float32}  # without an engine dtype: the parameters' own
        assert same_bits and same_fp32 and names


def test_the_push_asks_for_the_engines_dtype(monkeypatch):
    from humanline_cli.sampling import vllm as vllm_mod
    from tests.helpers.fake_vllm import fake_tokenizer, install_fake_vllm

    install_fake_vllm(monkeypatch, [], lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    asked = []
    monkeypatch.setattr(vllm_mod, "policy_weights", lambda policy, dtype=None: asked.append(dtype) or iter(()))
    sampler = vllm_mod.VLLMSampler("unused", fake_tokenizer(), timeout_s=10)
    sampler.push_weights(torch.nn.Linear(2, 2))
    sampler.llm.llm_engine.vllm_config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))
    sampler.push_weights(torch.nn.Linear(2, 2))
    assert asked == [None, torch.bfloat16]
