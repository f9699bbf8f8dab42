"""The memory estimate: exact parameter counts from a config alone, hand-computed bytes per
component, FSDP dividing the states, LoRA shrinking them, and the one-line 'will not fit'."""
from __future__ import annotations

import pytest
from transformers import LlamaConfig

from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.memory import GB, check_fits, count_params, estimate, lora_params, precision_bytes

# Llama-3-8B's published architecture (no weights needed)
LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)


def test_parameter_counts_from_the_config_alone():
    assert count_params(LLAMA3_8B) == 8_030_261_248
    # per layer, all-linear LoRA: r * ((h + 32*128) + 2 * (h + 8*128) + (32*128 + h) + 2 * (h + 14336) + (14336 + h))
    per_layer = (4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 2 * (4096 + 14336) + (14336 + 4096)
    assert lora_params(LLAMA3_8B, 16) == 16 * per_layer * 32 == 41_943_040


def test_bytes_per_component_are_the_trainers():
    n = 8_030_261_248
    full = estimate(LLAMA3_8B, seqs_per_micro=8, max_length=2048, params=n)
    assert (full.policy, full.grads, full.optimizer, full.reference) == (4 * n, 4 * n, 8 * n, 4 * n)
    # saved activations per token, bf16: per layer 2 * (4 * 14336 + 3 * 4096 + 2 * 4096 + 2 * 1024) + 4 * (2 * 4096
    # + 32 + 2) = 192_648 bytes (module docstring), outside the layers 2 * 3 * 4096 + 4 * 2 * 4096 = 57_344
    tokens = 8 * 2048
    assert full.activations == (192_648 * 32 + 57_344) * tokens
    chunk = (2**25 // 128256) * 128256 * 4  # 261 positions of fp32 logits
    assert full.transient == 4 * chunk
    assert full.step_extra == 4 * n and full.loading == 8 * n  # the policy and its deep copy
    assert full.total == full.training == 20 * n + full.activations + 4 * chunk
    fsdp = estimate(LLAMA3_8B, seqs_per_micro=8, max_length=2048, params=n, strategy="fsdp", ranks=8,
                    gradient_checkpointing=True)
    assert fsdp.policy == 4 * n / 8 and fsdp.optimizer == 8 * n / 8
    # checkpointing: each layer keeps its input (2 * 4096 bytes per token), plus one layer's full set
    assert fsdp.activations == (2 * 4096 * 32 + 192_648 + 57_344) * tokens
    root = 2 * 128256 * 4096 + 4096
    layer = (n - root) / 32
    # the root gathered in fp32 (its head computes in fp32) and the head's fp32 gradient; two bf16 layers and a gradient
    assert fsdp.transient == 4 * chunk + 4 * root + 4 * 128256 * 4096 + 3 * 2 * layer
    assert fsdp.loading == 8 * n and fsdp.total == fsdp.loading  # the whole model twice on every rank, then sharded
    sharded = estimate(LLAMA3_8B, seqs_per_micro=8, max_length=2048, params=n, strategy="fsdp", ranks=8,
                       gradient_checkpointing=True, loading="sharded", reference_bytes=2.0)
    # a bf16 reference keeps its root in fp32
    assert sharded.loading == 4 * n / 8 + (2 * (n - root) + 4 * root) / 8 + 4 * 128256 * 4096 / 8
    assert sharded.total == sharded.training
    lora = estimate(LLAMA3_8B, seqs_per_micro=8, max_length=2048, params=n, lora_r=16, moving_reference=False)
    a = 41_943_040
    assert (lora.policy, lora.grads, lora.optimizer, lora.reference) == (4 * (n + a), 4 * a, 8 * a, 0.0)
    moving = estimate(LLAMA3_8B, seqs_per_micro=8, max_length=2048, params=n, lora_r=16, moving_reference=True)
    assert moving.reference == 4 * a  # humanline: a second, frozen reference adapter
    fp32 = estimate(LLAMA3_8B, seqs_per_micro=8, max_length=2048, params=n, activation_bytes=4)
    assert fp32.activations - full.activations == 2 * (79_872 * 32 + 3 * 4096) * tokens  # the a-scaled terms double
    autocast = estimate(LLAMA3_8B, seqs_per_micro=8, max_length=2048, params=n, autocast=True)
    assert autocast.transient - full.transient == 2 * (n - 128256 * 4096)  # bf16 copies of the matmul weights


# h 64, MLP 128, 4 heads of 16 (2 KV heads), 2 layers, vocab 1,000, untied
SMALL = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


@pytest.mark.parametrize("precision, want", [
    # fp32: weights, gradients, AdamW (2 moments), the reference: 4 + 4 + 8 + 4 bytes a parameter; per token per
    # layer 4 * (4*128 + 3*64 + 2*64 + 2*32) + 4 * (2*64 + 4 + 2) = 4,120, outside 4 * 3*64 + 4 * 2*64 = 1,280
    ("fp32", dict(policy=4 * 202_048, grads=4 * 202_048, optimizer=8 * 202_048, reference=4 * 202_048,
                  activations=(2 * 4_120 + 1_280) * 16, transient=4 * 16 * 1000 * 4)),
    # bf16 autocast: fp32 master weights, gradients and AdamW, the reference counted fp32 (an upper bound);
    # activations 2 * 896 + 536 = 2,328 a layer, 2 * 192 + 512 outside; transient: the fp32 logits' chunks + bf16
    # copies of every weight but the embeddings (202,048 - 64,000)
    ("bf16", dict(policy=4 * 202_048, grads=4 * 202_048, optimizer=8 * 202_048, reference=4 * 202_048,
                  activations=(2 * 2_328 + 896) * 16, transient=4 * 16 * 1000 * 4 + 2 * (202_048 - 64_000))),
    ("fp64", dict(policy=8 * 202_048, grads=8 * 202_048, optimizer=16 * 202_048, reference=8 * 202_048,
                  activations=(2 * (8 * 896 + 536) + 8 * 192 + 512) * 16, transient=4 * 16 * 1000 * 8)),
])
def test_the_estimate_holds_each_precisions_dtypes(precision, want):
    """Two sequences of 8 tokens on a 202,048-parameter model, by hand, in each backend.precision."""
    assert count_params(SMALL) == 202_048  # 2 x 1,000 x 64 + 64 + 2 x (4,096 + 2 x 2,048 + 4,096 + 3 x 8,192 + 128)
    est = estimate(SMALL, seqs_per_micro=2, max_length=8, **precision_bytes(precision))
    assert {k: getattr(est, k) for k in want} == want
    assert est.step_extra == want["grads"]  # AdamW foreach: one gradient-sized temporary
    assert est.training == est.steady + max(est.activations + est.transient, est.step_extra)


def test_precision_bytes_under_fsdp_and_lora():
    """FSDP2 bf16: no autocast copies, the reference's decoder in bf16 (its root fp32: 2 * 73,984 + 4 * 128,064 on
    the small model); a LoRA base under autocast loads in bf16."""
    assert precision_bytes("bf16", fsdp=True) == {"weight_bytes": 4.0, "activation_bytes": 2.0,
                                                  "reference_bytes": 2.0, "autocast": False, "base_bytes": None}
    fsdp = estimate(SMALL, seqs_per_micro=2, max_length=8, strategy="fsdp", ranks=2, **precision_bytes("bf16", fsdp=True))
    assert fsdp.reference == (2 * 73_984 + 4 * 128_064) / 2 and fsdp.optimizer == 8 * 202_048 / 2
    assert precision_bytes("bf16", lora=True)["base_bytes"] == 2.0
    assert precision_bytes("fp32") == {"weight_bytes": 4.0, "activation_bytes": 4.0, "reference_bytes": None,
                                       "autocast": False, "base_bytes": None}


def test_a_run_that_will_not_fit_says_so_in_one_line():
    est = estimate(LLAMA3_8B, seqs_per_micro=8, max_length=2048, params=8_030_261_248)
    msg = check_fits(est, 80 * GB)
    assert msg is not None and "\n" not in msg and "backend.strategy=fsdp" in msg and "will not fit" in msg
    small = estimate(LLAMA3_8B, seqs_per_micro=2, max_length=512, params=8_030_261_248, lora_r=16,
                     moving_reference=False, gradient_checkpointing=True)
    n, a = 8_030_261_248, 41_943_040
    assert check_fits(small, 80 * GB) is None
    per_token = 2 * 4096 * 32 + 192_648 + 57_344  # checkpointed layers' inputs + one layer + outside the layers
    chunk = (2**25 // 128256) * 128256 * 4
    assert small.total == pytest.approx(4 * (n + a) + 4 * a + 8 * a + per_token * 2 * 512 + 4 * chunk)  # 31.0 GiB


def test_gpu_check_fails_in_one_line_without_cuda(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "humanline_cli.lab.gpu_check", "--out", str(tmp_path / "g")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == (
        "humanline: error: gpu-check needs a CUDA device (torch.cuda.is_available() is False on this machine)")
    assert not (tmp_path / "g").exists()


def test_gpu_check_step_checks_run_on_cpu_and_fail_with_exit_1(tmp_path):
    """`gpu-check --device cpu`: the step checks (lab/step_bench.py) on the tiny shape: one row per objective x
    humanline with step time, tokens/s and the memory estimate, JSON written, exit 0; a diverging run
    (AdamW lr 1e30: non-finite loss) is a failed row and exit 1. (The CUDA-only fields, MFU and
    max_memory_allocated, are None here: this is not a substitute for a GPU run.)"""
    import json
    import math
    import subprocess
    import sys

    def check(out, *extra):
        r = subprocess.run([sys.executable, "-m", "humanline_cli.lab.gpu_check", "--device", "cpu", "--out", str(out),
                            *extra], capture_output=True, text=True, timeout=300)
        return r, json.loads((out / "gpu_check.json").read_text())

    r, res = check(tmp_path / "ok")
    assert r.returncode == 0, r.stdout + r.stderr
    assert res["ok"] is True and res["device"] == "cpu" and res["gpus"] == 0
    names = [c["check"] for c in res["checks"]]
    assert names == [f"step_{o}_hl-{h}" for o in PROPERTIES for h in ("false", "true")]  # every registered objective
    seqs = {"dpo": 4, "ipo": 4, "kto": 2, "grpo": 8}  # 2 x micro pairs, micro, micro x n samples (micro 2, n 4)
    for c in res["checks"]:
        assert c["ok"] and c["shape"] == "tiny" and c["seqs_per_micro"] == seqs[c["check"].split("_")[1]]
        # step_s is written rounded to 1e-4 s, tokens_per_s from the unrounded time: a relative gap up to
        # 0.5e-4 / step_s, plus 0.05 tokens/s of rounding on tokens_per_s itself
        rounding = 0.5e-4 / c["step_s"] + 0.05 / c["tokens_per_s"]
        assert c["step_s"] > 0 and c["tokens_per_s"] == pytest.approx(c["seqs_per_micro"] * 64 / c["step_s"],
                                                                      rel=1.01 * rounding)
        assert math.isfinite(c["loss"]) and c["estimate_gib"] > 0 and c["mfu"] is None and c["peak_gib"] is None
    r, res = check(tmp_path / "bad", "--lr", "1e30")
    assert r.returncode == 1 and res["ok"] is False
    bad = [c for c in res["checks"] if not c["ok"]]
    assert bad and all("non-finite loss" in c["error"] for c in bad)
    assert "FAIL step_" in r.stdout


def test_release_freed_hands_freed_heap_memory_back():
    """Freed small blocks stay resident (glibc keeps them) until release_freed: a sweep's next job then sees
    them as available host memory. 200 MB of 2 KB blocks, freed under a live block that pins the heap's top."""
    from humanline_cli.memory import release_freed, rss_bytes

    blocks = [bytearray(2000) for _ in range(100_000)]
    pin = bytearray(10)  # noqa: F841 - allocated after the blocks, so a plain heap shrink cannot reach them
    held = rss_bytes()
    del blocks
    release_freed()
    assert held - rss_bytes() > 150e6
