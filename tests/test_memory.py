"""The memory estimate: exact parameter counts from a config alone, hand-computed bytes per
component, FSDP dividing the states, LoRA shrinking them, and the one-line 'will not fit'."""
from __future__ import annotations

import pytest
from transformers import LlamaConfig

from humanline_cli.memory import GB, check_fits, count_params, estimate, lora_params

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
    assert full.activations == 34 * 2048 * 8 * 4096 * 32 + 2**27
    fsdp = estimate(LLAMA3_8B, seqs_per_micro=8, max_length=2048, params=n, strategy="fsdp", ranks=8,
                    gradient_checkpointing=True)
    assert fsdp.policy == 4 * n / 8 and fsdp.optimizer == 8 * n / 8
    assert fsdp.activations == 2 * 2048 * 8 * 4096 * 32 + 2**27
    lora = estimate(LLAMA3_8B, seqs_per_micro=8, max_length=2048, params=n, lora_r=16, moving_reference=False)
    a = 41_943_040
    assert (lora.policy, lora.grads, lora.optimizer, lora.reference) == (4 * (n + a), 4 * a, 8 * a, 0.0)
    moving = estimate(LLAMA3_8B, seqs_per_micro=8, max_length=2048, params=n, lora_r=16, moving_reference=True)
    assert moving.reference == 4 * a  # humanline: a second, frozen reference adapter


def test_a_run_that_will_not_fit_says_so_in_one_line():
    est = estimate(LLAMA3_8B, seqs_per_micro=8, max_length=2048, params=8_030_261_248)
    msg = check_fits(est, 80 * GB)
    assert msg is not None and "\n" not in msg and "backend.strategy=fsdp" in msg and "will not fit" in msg
    small = estimate(LLAMA3_8B, seqs_per_micro=2, max_length=512, params=8_030_261_248, lora_r=16,
                     moving_reference=False, gradient_checkpointing=True)
    n, a = 8_030_261_248, 41_943_040
    assert check_fits(small, 80 * GB) is None
    assert small.total == pytest.approx(4 * (n + a) + 4 * a + 8 * a + 2 * 512 * 2 * 4096 * 32 + 2**27)  # 30.9 GiB


def test_gpu_check_fails_in_one_line_without_cuda(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "humanline_cli.bench.gpu_check", "--out", str(tmp_path / "g")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == (
        "humanline: error: gpu-check needs a CUDA device (torch.cuda.is_available() is False on this machine)")
    assert not (tmp_path / "g").exists()
