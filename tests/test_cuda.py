"""The checks only a CUDA machine can run, marked gpu: `just test-gpu` runs them (minutes on one GPU; the
collectives need two), `just test` leaves them out, and each fails, never skips, where CUDA is missing
(conftest.py). A bf16 step's peak memory against the estimate, a one-process vLLM engine on GPU 0 and an engine per
rank (external_launcher, sleep mode) on each rank's own GPU, a weight push then log-probs, NCCL collectives between
two GPUs. Each is the product's own code, as `just gpu-check` runs it, at the smallest shape that still measures
what the check is about."""
from __future__ import annotations

import socket

import pytest

from tests.helpers.ranks import run_two_ranks

pytestmark = pytest.mark.gpu

GIB = 1024**3


def test_a_bf16_step_peaks_within_25_percent_of_the_memory_estimate():
    # Qwen2.5-1.5B's shape (random weights): the weights and AdamW (~18 GiB) dwarf the CUDA context and the
    # allocator's fixed costs, which the estimate leaves out; a tiny shape would measure those instead
    from humanline_cli.lab.step_bench import run

    rows = run("qwen2.5-1.5b", "cuda", objectives=("dpo",), micro=1, tokens=512, steps=2, tol=0.25)
    assert [r["check"] for r in rows] == ["step_dpo_hl-false", "step_dpo_hl-true"]
    for r in rows:
        assert r["ok"], r  # finite losses, and the peak within 25% of memory.estimate (its errors in the row)
        assert 0.75 <= r["memory_ratio"] <= 1.25 and r["peak_gib"] > 10


def test_a_one_process_engine_takes_its_share_of_gpu_0_and_nothing_elsewhere():
    # a one-process run's device is cuda:0 (another is refused in one line: vLLM's one-process executor always
    # takes device 0); its engine must take its share there and open nothing on the other GPUs. The engine per
    # rank of a multi-rank run: test_each_ranks_engine_starts_sleeps_and_wakes_on_its_own_gpu
    import tempfile

    import torch

    from humanline_cli.lab.step_bench import build
    from humanline_cli.lab.vllm_rows import _tokenizer
    from humanline_cli.sampling.vllm import VLLMSampler

    torch.cuda.set_device(0)
    free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
    total = torch.cuda.mem_get_info(0)[1]
    with tempfile.TemporaryDirectory() as tmp:
        build("tiny-vllm", "cpu").to(torch.bfloat16).save_pretrained(tmp)  # bf16, as a run's engine on CUDA
        sampler = VLLMSampler(tmp, _tokenizer(), seed=0, gpu_memory_utilization=0.2, max_model_len=256, timeout_s=600)
        try:
            used = [free[i] - torch.cuda.mem_get_info(i)[0] for i in range(len(free))]
        finally:
            sampler.close()
    assert used[0] >= 0.1 * total, used  # the engine's KV cache: most of its 20% share
    assert all(u < 2 * GIB for u in used[1:]), used  # another GPU: at most this process's own context


def test_each_ranks_engine_starts_sleeps_and_wakes_on_its_own_gpu():
    # two spawned ranks (NCCL), each with the run's sampler under vLLM's external_launcher executor and sleep mode:
    # the engine on cuda:LOCAL_RANK, its share of that GPU after start, freed by the sleep (level 2), back after the
    # push that wakes it, and its greedy log-probs after the push against transformers (lab/vllm_rows.ranks_run,
    # the gpu-check row of the same name)
    import torch

    assert torch.cuda.device_count() >= 2, f"needs 2 GPUs, this machine has {torch.cuda.device_count()}"
    from humanline_cli.lab.vllm_rows import RANKS_CHECK, ranks_run

    (row,) = ranks_run("tiny-vllm", nproc=2, gpu_memory_utilization=0.2)
    assert row["check"] == RANKS_CHECK and row["ok"], row
    assert [(r["rank"], r["engine_device"], r["executor"]) for r in row["ranks"]] == [
        (0, "cuda:0", "external_launcher"), (1, "cuda:1", "external_launcher")], row
    for r in row["ranks"]:
        assert 0.1 <= r["share_of_gpu"] <= 0.3 and r["freed_by_sleep_gib"] >= 0.5 * r["started_gib"], r
        assert r["tokens"] > 0 and r["mean_abs_diff"] <= 0.05, r


def test_a_weight_push_then_log_probs_match_the_pushed_model():
    # vLLM at bf16 against transformers at bf16 after a push of other weights (lab/vllm_rows.py's bound, 0.05
    # mean absolute log-prob difference), and the prefix cache reset that keeps stale KV out
    from humanline_cli.lab.vllm_rows import run

    rows = {r["check"]: r for r in run("tiny-vllm", "cuda", calls=(4,), prompt_tokens=100, new_tokens=8,
                                       gpu_memory_utilization=0.2)}
    assert list(rows)[:4] == ["vllm_start", "vllm_push", "vllm_logprobs_after_push", "vllm_stale_prefix_cache"], rows
    for name in ("vllm_start", "vllm_push", "vllm_logprobs_after_push", "vllm_stale_prefix_cache"):
        assert rows[name]["ok"], rows[name]
    assert rows["vllm_logprobs_after_push"]["tokens"] > 0 and rows["vllm_logprobs_after_push"]["mean_abs_diff"] <= 0.05


def _nccl_rank(rank: int, port: int, out) -> None:
    import os

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as tdist

    from humanline_cli.backend import all_agree, all_reduce_sum, init_distributed, wait_for_rank0

    dist = init_distributed("cuda", 60)
    box = [f"from rank {rank}"]
    wait_for_rank0()  # the gloo wait group beside NCCL
    tdist.broadcast_object_list(box, src=0)
    x = all_reduce_sum(torch.tensor([rank + 1.0], device="cuda"), dist)
    out.put((rank, tdist.get_backend(), torch.cuda.current_device(), all_agree(True, dist),
             all_agree(rank == 0, dist), float(x), box[0]))
    tdist.destroy_process_group()


def test_nccl_collectives_between_two_gpus():
    import torch

    assert torch.cuda.device_count() >= 2, f"needs 2 GPUs, this machine has {torch.cuda.device_count()}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = run_two_ranks("spawn", _nccl_rank, lambda ctx: (port,), 180)  # CUDA in a forked child is undefined
    # each rank on its own GPU; 1 + 2 summed; one rank's False makes every rank's answer False; rank 0's object
    assert got == [(0, "nccl", 0, True, False, 3.0, "from rank 0"), (1, "nccl", 1, True, False, 3.0, "from rank 0")]
