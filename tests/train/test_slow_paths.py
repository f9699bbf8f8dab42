"""The CUDA path's slow or unsafe corners, each checked on CPU: the gradient-norm all-reduce of an FSDP2 rank without
gradients (joined, on the rank's device), DDP's log-probs in chunks of the LM head (no (N, T, V) logits), a LoRA
run's frozen base in the compute dtype, vLLM's CUDA graphs on by default on CUDA."""
from __future__ import annotations

import torch


class _ShardedParam:
    """Unit-test helper: an FSDP2 parameter (a DTensor's to_local) on a device this machine has no kernels for
    (meta stands in for cuda:N), without a gradient this step."""

    def __init__(self):
        self.grad = None
        self._local = torch.empty(4, device="meta")

    def to_local(self):
        return self._local


def test_a_rank_without_gradients_joins_the_norm_all_reduce_on_its_device(monkeypatch):
    import humanline_cli.backend as backend
    from humanline_cli.backend import Dist, clip_grad_norm

    seen = []

    def all_reduce_sum(t, dist):  # the other rank's squared norm, 4.0, comes back
        seen.append((t.device.type, t.dtype))
        return torch.tensor(4.0)

    monkeypatch.setattr(backend, "all_reduce_sum", all_reduce_sum)
    norm = clip_grad_norm([_ShardedParam(), _ShardedParam()], 1.0, Dist(rank=1, world_size=2))
    # the all-reduce happened (the other ranks are in it), with a tensor on the parameters' device
    assert seen == [("meta", torch.float32)] and norm == 2.0


def _tiny_llama(dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype)


def test_ddp_computes_log_probs_in_chunks_equal_to_full_logits(tmp_path):
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel

    from humanline_cli.core.batches import Seqs
    from humanline_cli.core.logprobs import _full_logits_token_logps, token_logps

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _tiny_llama()
        ddp = DistributedDataParallel(model)
        ids = torch.randint(1, 97, (3, 10), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[2, 7:] = 0
        loss = mask.bool() & (torch.arange(10) >= 4)
        seqs = Seqs(ids, mask, loss)
        rows = []
        hook = model.lm_head.register_forward_hook(lambda m, i, o: rows.append(tuple(o.shape)))
        got = token_logps(ddp, seqs, chunk_size=4)
        hook.remove()
        # 13 completion positions (6 + 6 + 3 minus the first of each... t predicts t+1): chunks of <= 4 rows
        # of logits, never a (3, 10, 97) block
        assert rows and all(len(r) == 2 and r[0] <= 4 for r in rows), rows
        want = _full_logits_token_logps(model, seqs)
        assert torch.allclose(got, want, atol=1e-12, rtol=0)  # float64: equal in exact arithmetic
        got.sum().backward()  # through DDP's forward: its reducer averages the gradients
        g_ddp = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        want.sum().backward()
        assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(g_ddp, (p.grad for p in model.parameters())))
    finally:
        tdist.destroy_process_group()


def test_a_lora_base_loads_in_the_compute_dtype_under_bf16_autocast(tmp_path, monkeypatch):
    """Under bf16 autocast (CUDA's default) a LoRA run's frozen base loads in bf16: half the bytes, its matmuls
    run in bf16 anyway; the adapters (what AdamW trains) stay fp32. Run here with a CPU autocast backend."""
    from hydra import compose, initialize_config_module

    from humanline_cli.backend import Backend
    from humanline_cli.config import resolve
    from humanline_cli.core.lora import apply_lora
    from humanline_cli.train.build import _load_policy
    from humanline_cli.train.fit import memory_estimate

    _tiny_llama(torch.float32).save_pretrained(tmp_path / "m")
    with initialize_config_module(config_module="conf", version_base="1.3"):
        spec = resolve(compose("train", overrides=["task=custom", f"model.name_or_path={tmp_path / 'm'}",
                                                   "data.path=unused.jsonl", "task.judge.kind=none", "model.lora.r=4",
                                                   "train.max_length=16", "train.max_prompt_length=8",
                                                   "backend.precision=bf16"]))  # CUDA's default, resolved here
    backend = Backend(torch.device("cpu"), torch.bfloat16)  # what make_backend gives on CUDA, on this CPU
    policy, sharded = _load_policy(spec, str(tmp_path / "m"), backend, "single")
    policy = apply_lora(policy, 4, 8, 0.0)
    trained = {n: p.dtype for n, p in policy.named_parameters() if p.requires_grad}
    frozen = {p.dtype for p in policy.parameters() if not p.requires_grad}
    assert not sharded and frozen == {torch.bfloat16} and trained and set(trained.values()) == {torch.float32}
    with backend.autocast():
        policy(input_ids=torch.tensor([[1, 2, 3]])).logits.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in policy.parameters() if p.requires_grad)
    # the estimate on CUDA counts the base at 2 bytes a parameter (and no autocast copies of it)
    n = sum(p.numel() for p in policy.parameters() if not p.requires_grad)
    t = sum(p.numel() for p in policy.parameters() if p.requires_grad)

    class Props:
        total_memory = 10**15

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    est = memory_estimate(spec, str(tmp_path / "m"), torch.device("cuda"))
    assert est.policy == 2 * n + 4 * t and est.loading == 2 * n + 4 * t


def test_vllm_uses_cuda_graphs_by_default_on_cuda_and_eager_on_cpu(monkeypatch):
    from humanline_cli.sampling.vllm import VLLMSampler
    from tests.helpers.fake_vllm import fake_tokenizer, install_fake_vllm

    install_fake_vllm(monkeypatch, [], lambda: 0)  # a CUDA platform
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert VLLMSampler("unused", fake_tokenizer(), timeout_s=10).llm.kwargs["enforce_eager"] is False
    assert VLLMSampler("unused", fake_tokenizer(), timeout_s=10, enforce_eager=True).llm.kwargs["enforce_eager"] is True
    import vllm

    monkeypatch.setattr(vllm.platforms, "current_platform", type("P", (), {"is_cpu": staticmethod(lambda: True)}))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # a fixed cache: the fake engine has no model config to size one
    assert VLLMSampler("unused", fake_tokenizer(), timeout_s=10).llm.kwargs["enforce_eager"] is True


def test_unseeded_vllm_sends_one_request_of_n_per_prompt(monkeypatch):
    """sampler.seeded=false: one request of n per prompt without a seed (vLLM batches its noise); the default sends
    one seeded request per completion (any split over ranks samples the same)."""
    from types import SimpleNamespace

    from humanline_cli.core.interfaces import SamplingParams
    from humanline_cli.sampling.vllm import VLLMSampler
    from tests.helpers.fake_vllm import fake_tokenizer, install_fake_vllm

    install_fake_vllm(monkeypatch, [], lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sent = []

    def generate(prompts, params, use_tqdm=False):  # children returned out of order: the sampler sorts them
        sent.extend((len(p["prompt_token_ids"]), sp.n, sp.seed) for p, sp in zip(prompts, params))
        return [SimpleNamespace(outputs=[SimpleNamespace(index=i, token_ids=[10 + i, 2], logprobs=[
            {10 + i: SimpleNamespace(logprob=-1.0 * i)}, {2: SimpleNamespace(logprob=-0.5)}])
            for i in reversed(range(sp.n))]) for sp in params]

    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=4, seed=7)
    fast = VLLMSampler("unused", fake_tokenizer(), timeout_s=10, seeded=False)
    fast.llm.generate = generate
    out = fast.generate([[5, 6], [7]], params)
    assert sent == [(2, 3, None), (1, 3, None)]
    assert out.token_ids == [[10, 2], [11, 2], [12, 2]] * 2 and out.logps[1] == [-1.0, -0.5]
    sent.clear()
    exact = VLLMSampler("unused", fake_tokenizer(), timeout_s=10)
    exact.llm.generate = generate
    exact.generate([[5, 6], [7]], params)
    assert [(length, n) for length, n, _ in sent] == [(2, 1)] * 3 + [(1, 1)] * 3 and all(s is not None for *_, s in sent)
    assert len({s for *_, s in sent}) == 6


def test_fsdp_decoding_gathers_each_layer_once_per_call_not_per_token(tmp_path, monkeypatch):
    """The transformers sampler on an FSDP2 policy (offline evaluation under FSDP) gathers the weights once per
    generate call; before, every decoded token re-gathered every layer. One gloo rank: FSDP2 still runs its
    unshard/reshard cycle, counted here; the completions equal the unsharded model's."""
    import torch.distributed as tdist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from humanline_cli.backend import shard_model
    from humanline_cli.core.interfaces import SamplingParams
    from humanline_cli.sampling.hf import HFSampler
    from humanline_cli.world.tokenizer import build_tokenizer

    tok = build_tokenizer()
    plain = _tiny_llama(torch.float32)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    prompts = [[5, 6, 7], [8, 9]]
    want = HFSampler(plain, tok, batch_size=4).generate(prompts, params)
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded = _tiny_llama(torch.float32)
        shard_model(sharded)
        gathers = []
        real = FSDPParamGroup.unshard

        def unshard(self, async_op=False):
            if not self.is_unsharded and self._all_gather_result is None:
                gathers.append(id(self))
            return real(self, async_op)

        monkeypatch.setattr(FSDPParamGroup, "unshard", unshard)
        got = HFSampler(sharded, tok, batch_size=4, lockstep=lambda x: x).generate(prompts, params)
        groups = 3  # two decoder layers and the root
        assert len(gathers) == groups and len(set(gathers)) == groups, len(gathers)
        assert got.token_ids == want.token_ids
        assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5) for a, b in zip(got.logps, want.logps))
        # training's setting is back: a forward of the layers reshards them after, the root stays gathered
        gathers.clear()
        sharded(input_ids=torch.tensor([[1, 2]]))
        sharded(input_ids=torch.tensor([[1, 2]]))
        assert len(gathers) == 2 * 2 + 1  # the layers twice, the root once
    finally:
        tdist.destroy_process_group()
