"""backend.precision on CPU: bf16 autocast runs (fp32 master weights and AdamW), `auto` chooses by a GEMM probe
cached once per machine (CPU, flags, torch version, shapes), the flags only gate which probes run, and the run's
header says what was chosen and why; the default (null) is the device's: fp32 on CPU, bf16 on CUDA."""
from __future__ import annotations

import json
import math

import pytest
import torch

from humanline_cli import config, precision
from humanline_cli.backend import make_backend
from humanline_cli.config import compose_train, resolve
from humanline_cli.schema import Precision
from humanline_cli.train.build import resolve_precision
from tests.helpers.cli import FAST, TINY_WORLD, run_cli

AMX = ("avx2", "avx512f", "amx_bf16", "amx_tile")


def test_decide_names_the_measured_ratio_and_the_instructions():
    amx = precision.decide({"fp32_gflops": 400.0, "bf16_gflops": 2400.0, "bf16_flags": ["amx_bf16"]})
    assert amx == precision.Choice("bf16", "bf16 autocast: bf16 GEMM 6.0x fp32 on this CPU (amx_bf16)", 6.0)
    slow = precision.decide({"fp32_gflops": 400.0, "bf16_gflops": 520.0, "bf16_flags": ["avx512_bf16"]})
    assert slow.precision == "fp32" and slow.speedup == pytest.approx(1.3)  # 520 / 400, under 1.5
    assert slow.why == "fp32: bf16 GEMM only 1.30x fp32 on this CPU (avx512_bf16), under 1.5x"
    none = precision.decide({"fp32_gflops": 400.0, "bf16_gflops": None, "bf16_flags": []})
    assert none.precision == "fp32" and none.speedup is None and "no bf16 instructions" in none.why


def test_no_bf16_probe_runs_on_a_cpu_without_bf16_instructions(monkeypatch):
    """An AVX2-only CPU emulates bf16 GEMMs (~0.3 GFLOP/s): only fp32 is timed there; with AMX both are, in turns."""
    timed = []
    monkeypatch.setattr(precision, "gemm_seconds", lambda a, b: timed.append(a.dtype) or 1e-3)
    probe = precision.measure([(8, 16)], ("avx2", "fma", "avx512f"))
    assert set(timed) == {torch.float32} and len(timed) == precision.PROBE_ROUNDS and probe["bf16_gflops"] is None
    # 2 * 512 rows * 8 * 16 FLOPs in 1 ms: 0.131072 GFLOP/s
    assert probe["fp32_gflops"] == pytest.approx(2 * 512 * 8 * 16 / 1e-3 / 1e9)
    timed.clear()
    probe = precision.measure([(8, 16)], AMX)
    assert timed == [torch.float32, torch.bfloat16] * precision.PROBE_ROUNDS and probe["bf16_flags"] == ["amx_bf16"]


def test_the_choice_is_measured_once_per_machine_and_torch_version(monkeypatch, tmp_path):
    calls = []

    def fake_measure(shapes, flags):
        calls.append(shapes)
        return {"fp32_gflops": 100.0, "bf16_gflops": 250.0, "bf16_flags": ["amx_bf16"]}

    monkeypatch.setattr(precision, "measure", fake_measure)
    monkeypatch.setattr(precision, "cpu_info", lambda: ("Some Xeon", AMX))
    shapes = precision.model_shapes(None)  # no config: a 1,024-wide model's
    assert shapes == [(1024, 1024), (1024, 4096), (4096, 1024)]
    first = precision.choose(shapes, tmp_path)
    assert first == precision.Choice("bf16", "bf16 autocast: bf16 GEMM 2.5x fp32 on this CPU (amx_bf16)", 2.5)
    assert precision.choose(shapes, tmp_path) == first and len(calls) == 1  # read back, not measured again
    (stored,) = (tmp_path / "precision").glob("cpu-*.json")
    assert json.loads(stored.read_text())["cpu"] == "Some Xeon"
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # another torch: its kernels may differ, so measured again
    precision.choose(shapes, tmp_path)
    monkeypatch.setattr(precision, "cpu_info", lambda: ("Some EPYC", ("avx512_bf16",)))
    precision.choose(shapes, tmp_path)
    precision.choose([(64, 64)], tmp_path)  # another model's shapes
    assert len(calls) == 4 and len(list((tmp_path / "precision").glob("cpu-*.json"))) == 4


def test_bf16_on_cpu_is_autocast_over_fp32_master_weights():
    backend = make_backend("cpu", "bf16")
    assert backend.autocast_dtype == torch.bfloat16 and backend.weights_dtype == torch.float32
    assert backend.param_dtype is None and "torch.bfloat16 autocast" in backend.describe()
    assert make_backend("cpu", "auto").autocast_dtype is None  # not measured yet (resolve_precision replaces it)


def _auto_on_cpu(monkeypatch, tmp_path, cpu: tuple, fp32_s: float, bf16_s: float):
    """`backend=cpu backend.precision=auto` resolved as `humanline train` resolves it, on a CPU with `cpu`'s name and
    flags whose GEMMs take fp32_s / bf16_s seconds (a 16-wide model's shapes, so the warm-up calls cost nothing)."""
    timed = []
    monkeypatch.setattr(precision, "cpu_info", lambda: cpu)
    monkeypatch.setattr(precision, "model_shapes", lambda cfg: [(8, 16), (16, 8)])
    monkeypatch.setattr(precision, "gemm_seconds",
                        lambda a, b: timed.append(a.dtype) or (bf16_s if a.dtype == torch.bfloat16 else fp32_s))
    spec = resolve(compose_train(["backend=cpu", "backend.precision=auto", f"world_cache={tmp_path}"]))
    spec, backend = resolve_precision(spec, make_backend("cpu", "auto"), "cpu", "single", str(tmp_path))  # no config
    return spec.backend_cfg.precision, backend, timed


def test_auto_on_cpu_measures_and_picks_bf16_from_1_5x(monkeypatch, tmp_path):
    """bf16 GEMMs 1.6x as fast as fp32 (1 ms against 0.625 ms): bf16 autocast, the ratio in the header; 1.4x: fp32,
    saying the ratio was under the threshold. Both dtypes are timed, in turns."""
    chosen, backend, timed = _auto_on_cpu(monkeypatch, tmp_path / "a", ("Xeon A", AMX), 1e-3, 1e-3 / 1.6)
    assert chosen == Precision.bf16 and backend.autocast_dtype == torch.bfloat16
    assert backend.why == "bf16 autocast: bf16 GEMM 1.6x fp32 on this CPU (amx_bf16)"
    assert timed == [torch.float32, torch.bfloat16] * precision.PROBE_ROUNDS * 2  # 2 shapes
    chosen, backend, _ = _auto_on_cpu(monkeypatch, tmp_path / "b", ("Xeon B", AMX), 1e-3, 1e-3 / 1.4)
    assert chosen == Precision.fp32 and backend.autocast_dtype is None
    assert backend.why == "fp32: bf16 GEMM only 1.40x fp32 on this CPU (amx_bf16), under 1.5x"


def test_auto_on_an_avx2_cpu_runs_no_bf16_probe_and_stays_fp32(monkeypatch, tmp_path):
    chosen, backend, timed = _auto_on_cpu(monkeypatch, tmp_path, ("Some Core", ("avx", "avx2", "fma")), 1e-3, 1e-6)
    assert chosen == Precision.fp32 and backend.autocast_dtype is None and set(timed) == {torch.float32}
    assert backend.why == "fp32: this CPU has no bf16 instructions (avx512_bf16, amx_bf16), so no bf16 probe ran"


@pytest.mark.parametrize("cuda, want", [(False, Precision.fp32), (True, Precision.bf16)])
def test_the_default_precision_is_the_devices_and_measures_nothing(monkeypatch, cuda, want):
    """backend=auto (the default) leaves backend.precision null: fp32 on a CPU-only machine whatever its bf16 speed
    (the same command trains alike on every CPU), bf16 where CUDA is; backend=cpu sets fp32 itself."""
    monkeypatch.setattr(precision, "measure", lambda *a: pytest.fail("the default precision measured"))
    monkeypatch.setattr(config, "_cuda_available", lambda: cuda)
    assert compose_train([]).backend.precision is None
    assert resolve(compose_train([])).backend_cfg.precision == want
    assert resolve(compose_train(["backend=cpu"])).backend_cfg.precision == Precision.fp32


def _run(tmp_path, name: str, *extra):
    out = tmp_path / name
    r = run_cli(["train", *TINY_WORLD, *FAST, "backend=cpu", "objective=dpo", f"hydra.run.dir={out}", *extra], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return " ".join(r.stderr.split()), rows


@pytest.mark.slow
def test_bf16_trains_on_cpu_with_log_ratios_exactly_zero_at_the_start(tmp_path, cache_dir):
    """bf16 autocast on CPU: the reference runs the policy's computation (the same weights, autocast and fp32 head),
    so at step 1 every log-ratio is exactly 0 and DPO's loss is exactly ln 2 (in float32: 0.6931471824645996)."""
    header, rows = _run(tmp_path, "bf16", "backend.precision=bf16")
    assert "cpu (torch.bfloat16 autocast" in header
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-7) and rows[0]["logratio_mean"] == 0.0
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows) and rows[-1]["loss"] != rows[0]["loss"]
    summary = json.loads((tmp_path / "bf16" / "summary.json").read_text())
    assert summary["precision"] == {"compute": "bfloat16", "why": None}


@pytest.mark.slow
def test_auto_precision_says_what_it_chose_and_why(tmp_path, cache_dir):
    """The first run measures and stores the probe; its header says the choice the stored probe gives. A stored probe
    of a 6x-faster bf16 then makes the next run bf16, with that reason in its header."""
    header, _ = _run(tmp_path, "first", "backend.precision=auto")
    (stored,) = (cache_dir / "precision").glob("cpu-*.json")
    choice = precision.decide(json.loads(stored.read_text())["probe"])
    assert choice.why in header
    data = json.loads(stored.read_text())
    data["probe"] = {"fp32_gflops": 400.0, "bf16_gflops": 2400.0, "bf16_flags": ["amx_bf16"]}
    stored.write_text(json.dumps(data))
    header, rows = _run(tmp_path, "second", "backend.precision=auto")
    assert "cpu (torch.bfloat16 autocast, 1 CPU threads; bf16 autocast: bf16 GEMM 6.0x fp32 on this CPU (amx_bf16))" \
        in header
    assert rows[0]["logratio_mean"] == 0.0
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["precision"] == {"compute": "bfloat16",
                                    "why": "bf16 autocast: bf16 GEMM 6.0x fp32 on this CPU (amx_bf16)"}
