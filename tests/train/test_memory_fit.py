"""Memory that fits: the host memory a CPU run may take (MemAvailable, a cgroup's limit), the largest micro-batch
whose estimate fits under train.micro_batch_size=auto, a size set by hand refused in one line naming one that
fits, the evaluation's memory in the check, and a vLLM-cpu engine's share taken off the budget."""
from __future__ import annotations

import pytest
import torch

from humanline_cli.memory import GB, generate_bytes, host_available_bytes, largest_fitting, size
from humanline_cli.train.fit import CPU_RSS_OVER_LIVE as SLACK


def test_host_memory_is_memavailable_capped_by_the_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert host_available_bytes(str(meminfo), str(cg)) == 20000000 * 1024  # no cgroup files: MemAvailable
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text("123\n")
    assert host_available_bytes(str(meminfo), str(cg)) == 20000000 * 1024  # no limit set
    # a 16 GiB limit holding 6 GiB, 2 GiB of it reclaimable page cache: 16 - (6 - 2) = 12 GiB left
    (cg / "memory.max").write_text(f"{16 * GB}\n")
    (cg / "memory.current").write_text(f"{6 * GB}\n")
    (cg / "memory.stat").write_text(f"anon 1\ninactive_file {2 * GB}\nactive_file 5\n")
    assert host_available_bytes(str(meminfo), str(cg)) == 12 * GB
    assert host_available_bytes(str(tmp_path / "none"), str(tmp_path / "none")) is None


def _limit(level, v1: bool, limit: int, usage: int, inactive: int = 0) -> None:
    level.mkdir(parents=True, exist_ok=True)
    (level / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(f"{limit}\n")
    (level / ("memory.usage_in_bytes" if v1 else "memory.current")).write_text(f"{usage}\n")
    (level / "memory.stat").write_text(f"{'total_' if v1 else ''}inactive_file {inactive}\n")


@pytest.mark.parametrize("v1", [False, True])
def test_the_process_own_cgroup_below_the_mount_root_caps_host_memory(tmp_path, v1):
    """A SLURM job's --mem (or a systemd scope) is a cgroup below the mount's root, named in /proc/self/cgroup:
    every level from it up to the root is read and the smallest room wins."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   20000000 kB\n")  # 19.07 GiB
    mount = tmp_path / "cg"
    base = mount / "memory" if v1 else mount
    own = tmp_path / "self_cgroup"
    own.write_text("12:memory:/slurm/uid_0/job_7\n4:cpu,cpuacct:/slurm\n" if v1 else "0::/slurm/uid_0/job_7\n")
    no_limit = 2**63 - 4096 if v1 else "max"
    (base / "slurm" / "uid_0" / "job_7").mkdir(parents=True)
    (base / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(f"{no_limit}\n")
    assert host_available_bytes(str(meminfo), str(mount), str(own)) == 20000000 * 1024  # no limit anywhere
    # the job: 2 GiB, holding 1.5 GiB of which 0.5 GiB reclaimable cache -> 1 GiB left
    _limit(base / "slurm" / "uid_0" / "job_7", v1, 2 * GB, 3 * GB // 2, GB // 2)
    # the user's slice above it: 8 GiB holding 4 GiB -> 4 GiB
    _limit(base / "slurm" / "uid_0", v1, 8 * GB, 4 * GB)
    assert host_available_bytes(str(meminfo), str(mount), str(own)) == 1 * GB
    # a level above with less room wins: slurm/ at 3 GiB holding 2.75 GiB -> 0.25 GiB
    _limit(base / "slurm", v1, 3 * GB, 11 * GB // 4)
    assert host_available_bytes(str(meminfo), str(mount), str(own)) == GB / 4
    # with no /proc/self/cgroup (or a namespace's "/"), only the mount's root is read: MemAvailable here
    assert host_available_bytes(str(meminfo), str(mount), str(tmp_path / "none")) == 20000000 * 1024
    # a container without a cgroup namespace: its path is not under the mount, whose root is its own cgroup
    own.write_text("12:memory:/docker/abc\n" if v1 else "0::/docker/abc\n")
    _limit(base, v1, 5 * GB, GB)
    assert host_available_bytes(str(meminfo), str(mount), str(own)) == 4 * GB


def test_largest_fitting_divides_the_share():
    # 32 units a rank: divisors 32, 16, 8, 4, 2, 1; those <= 6 fit, so 4 (6 and 5 do not divide 32)
    assert largest_fitting(32, 1, lambda m: m <= 6) == 4
    assert largest_fitting(32, 2, lambda m: m <= 1) is None  # kto's z0 needs at least 2
    assert largest_fitting(12, 1, lambda m: True) == 12


def test_generate_bytes_by_hand():
    from transformers import LlamaConfig

    c = LlamaConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=4)
    # KV cache: 2 x 3 layers x kv 4 x 4 bytes x 5 prompts x (6 + 2) tokens = 3840; prefill, one layer over the
    # prompts: 4 x (4 x 16 + 3 x 8 + 2 x 8 + 2 x 4) x 5 x 6 = 13440; logits 4 x 5 x 100 = 2000
    assert generate_bytes(c, 5, 6, 2, 4.0) == 3840 + 13440 + 2000


@pytest.fixture
def model_dir(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                head_dim=32).save_pretrained(tmp_path)
    return tmp_path


def _spec(model_dir, *extra):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    with initialize_config_module(config_module="conf", version_base="1.3"):
        return resolve(compose("train", overrides=["backend=cpu", "backend.precision=fp32", "objective=grpo",
                                                   f"model.name_or_path={model_dir}", "data.prompts=x.jsonl",
                                                   "train.max_length=64", "train.max_prompt_length=32",
                                                   "eval.max_new_tokens=16", *extra]))


def _host(monkeypatch, nbytes):
    from humanline_cli.train import fit

    monkeypatch.setattr(fit, "host_available_bytes", lambda: float(nbytes))


def test_auto_takes_the_largest_micro_batch_that_fits(model_dir, monkeypatch):
    from humanline_cli.train.fit import fit_memory, memory_estimate

    spec = _spec(model_dir, "data=online", "sampler=hf", "objective.batch_size=32", "eval.batch_size=1")
    assert spec.train.micro_auto and spec.train.micro_batch_size == 32  # the whole share until fitted
    cpu = torch.device("cpu")
    train_peak = {m: max(e.training, e.loading) for m in (32, 16, 8, 4)
                  for e in [memory_estimate(spec, str(model_dir), cpu, micro=m)]}
    # a host where 90% of it holds a micro-batch of 8 groups but not 16
    # on CPU 90% of the host, over the allocator's slack (CPU_RSS_OVER_LIVE), must hold the estimate
    host = (train_peak[8] + train_peak[16]) / 2 / 0.9 * SLACK
    _host(monkeypatch, host)
    fitted, est = fit_memory(spec, str(model_dir), cpu)
    assert fitted.train.micro_batch_size == 8 and fitted.train.accumulation == 4
    assert max(est.training, est.loading) == train_peak[8] <= 0.9 * host / SLACK < train_peak[16]
    assert fitted.notes[-1].startswith("train.micro_batch_size=auto: 8 of 32 units")
    _host(monkeypatch, 10**15)  # room for everything: the whole share, as before
    assert fit_memory(spec, str(model_dir), cpu)[0].train.micro_batch_size == 32


def test_a_micro_batch_set_by_hand_that_cannot_fit_names_one_that_does(model_dir, monkeypatch):
    from humanline_cli.errors import UserError
    from humanline_cli.train.fit import fit_memory, memory_estimate

    spec = _spec(model_dir, "data=online", "sampler=hf", "objective.batch_size=32", "train.micro_batch_size=32",
                 "eval.batch_size=1")
    cpu = torch.device("cpu")
    peak = {m: max(e.training, e.loading) for m in (32, 4, 2)
            for e in [memory_estimate(spec, str(model_dir), cpu, micro=m)]}
    _host(monkeypatch, (peak[4] + peak[2]) / 2 / 0.9 * SLACK)
    with pytest.raises(UserError) as e:
        fit_memory(spec, str(model_dir), cpu)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("train.micro_batch_size=32 will not fit:")
    assert f"{size(peak[32])} estimated per device" in msg and "train.micro_batch_size=2 fits" in msg
    _host(monkeypatch, peak[2] / 0.9 * SLACK / 2)  # not even the smallest fits: the size asked for, then what else to try
    with pytest.raises(UserError) as e:
        fit_memory(spec, str(model_dir), cpu)
    assert str(e.value).startswith(f"train.micro_batch_size=32 will not fit: {size(peak[32])} estimated per device, "
                                   f"and no micro-batch does: the run will not fit: ") and "\n" not in str(e.value)
    _host(monkeypatch, peak[32] / 0.9 * SLACK * 1.01)  # it fits: the spec is unchanged, no note
    fitted, _ = fit_memory(spec, str(model_dir), cpu)
    assert fitted is spec


def test_the_evaluation_batch_is_checked(model_dir, monkeypatch):
    """Offline runs evaluate with transformers' generate: its KV cache over eval.batch_size prompts counts."""
    from humanline_cli.errors import UserError
    from humanline_cli.train.fit import fit_memory, memory_estimate

    small = _spec(model_dir, "objective=dpo", "eval.batch_size=4")
    big = _spec(model_dir, "objective=dpo", "eval.batch_size=4096", "eval.n_prompts=null")  # all: 4096 a call
    cpu = torch.device("cpu")
    e_small, e_big = (memory_estimate(s, str(model_dir), cpu) for s in (small, big))
    assert e_big.evaluating - e_small.evaluating == pytest.approx(
        generate_bytes(_llama(model_dir), 4092, 32, 16, 4.0), rel=1e-12)  # linear in the batch
    assert e_big.evaluating > max(e_big.training, e_big.loading)  # the evaluation is this run's peak
    _host(monkeypatch, max(e_big.training, e_big.loading) / 0.9 * SLACK * 1.01)
    with pytest.raises(UserError, match=r"^eval.batch_size=4096 will not fit: evaluation needs"):
        fit_memory(big, str(model_dir), cpu)
    assert fit_memory(small, str(model_dir), cpu)[1].evaluating == e_small.evaluating
    # evaluation never batches more prompts than it has: a huge eval.batch_size over 4 prompts is 4 a call
    few = _spec(model_dir, "objective=dpo", "eval.batch_size=1000000", "eval.n_prompts=4")
    assert memory_estimate(few, str(model_dir), cpu).evaluating == e_small.evaluating
    assert fit_memory(few, str(model_dir), cpu)[1].evaluating == e_small.evaluating  # not refused


def _llama(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def test_a_vllm_cpu_engine_takes_its_share_of_the_host(model_dir, monkeypatch):
    from humanline_cli.train.fit import VLLM_CPU_RUNTIME, device_memory

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _host(monkeypatch, 20 * GB)
    cpu = torch.device("cpu")
    spec = _spec(model_dir, "data=online", "sampler=vllm", "sampler.cpu_kvcache_gb=3")
    assert device_memory(spec, cpu, 1000) == (20 * GB, 3 * GB + 4 * 1000 + VLLM_CPU_RUNTIME)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM reads the variable first
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks on this host share it
    assert device_memory(spec, cpu, 1000) == (5 * GB, 2 * GB + 4 * 1000 + VLLM_CPU_RUNTIME)
    assert device_memory(_spec(model_dir, "data=online", "sampler=hf"), cpu, 1000) == (5 * GB, 0.0)


def test_a_vllm_cpu_engine_counts_the_cache_its_largest_call_needs(model_dir, monkeypatch):
    """The estimate's engine holds the KV cache the sampler sizes (sampling/kv_space.py): the larger of an online
    round (2 prompts x 4 samples) and the evaluation's one call (6 prompts), 8 sequences at max_model_len (64 tokens,
    2 blocks of 32), plus the block vLLM keeps empty; a token holds keys and values of 2 layers x 2 heads of 32 fp32.
    The user's VLLM_CPU_KVCACHE_SPACE wins, and a call whose size only the data knows takes the cap."""
    from transformers import AutoConfig

    from humanline_cli.train.fit import VLLM_CPU_RUNTIME, _vllm_cpu_bytes
    from humanline_cli.train.samplers import engine_call_sequences

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    config = AutoConfig.from_pretrained(model_dir)
    spec = _spec(model_dir, "data=online", "sampler=vllm", "data.prompts_per_round=2", "data.n=4", "eval.n_prompts=6")
    assert spec.sampler_cfg.max_model_len == 64 and engine_call_sequences(spec) == 8
    token = 2 * 2 * 2 * 32 * 4
    assert _vllm_cpu_bytes(spec, 1000, config) == (8 * 2 + 1) * 32 * token + 4 * 1000 + VLLM_CPU_RUNTIME
    every_prompt = _spec(model_dir, "data=online", "sampler=vllm", "eval.n_prompts=null")
    assert engine_call_sequences(every_prompt) is None
    assert _vllm_cpu_bytes(every_prompt, 1000, config) == 1 * GB + 4 * 1000 + VLLM_CPU_RUNTIME
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert _vllm_cpu_bytes(spec, 1000, config) == 2 * GB + 4 * 1000 + VLLM_CPU_RUNTIME


def test_the_readme_real_model_command_with_a_micro_batch_too_large_is_refused(smollm2, tmp_path):
    """The README's SmolLM2 command with train.micro_batch_size=256 train.batch_size=256 (2,048 sequences of 128
    tokens in one micro-batch, about 315 GiB): one line, exit 2, before any weight loads or any round is sampled."""
    import json

    from tests.helpers.cli import MODEL_CACHE, run_cli

    run = tmp_path / "run"
    r = run_cli(["train", "model=smollm2", "task=chat_arithmetic", "objective=grpo", "data=online", "sampler=vllm",
                 "+humanline=true", "train.micro_batch_size=256", "train.batch_size=256", f"world_cache={MODEL_CACHE}",
                 f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("humanline: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    # what it suggests depends on this machine's free memory (a micro-batch that fits, or what else to change)
    assert lines[0].startswith("humanline: error: train.micro_batch_size=256 will not fit: 315.")
    failed = json.loads((run / "failed.json").read_text())
    assert failed["wall_clock_s"].get("sample", 0) == 0 and not (run / "metrics.jsonl").exists()


def test_the_fsdp_evaluation_counts_what_each_sampler_gathers(model_dir):
    """Under FSDP2 transformers' sampler decodes with the whole policy gathered (sampling/hf.py `gathered`: every
    parameter in the compute dtype, fp32 here), beside its generate; a vLLM engine's weight push gathers one
    parameter at a time (sampling/vllm.py `policy_weights`), whose largest is the 256 x 64 embeddings (the MLP's
    128 x 64 is smaller), in the master weights' dtype."""
    from humanline_cli.memory import count_params
    from humanline_cli.train.fit import memory_estimate

    fsdp = ("backend.strategy=fsdp", "backend.nproc=2", "data=online", "eval.batch_size=3")
    cpu = torch.device("cpu")
    config = _llama(model_dir)
    n = count_params(config)
    hf = memory_estimate(_spec(model_dir, *fsdp, "sampler=hf"), str(model_dir), cpu)
    assert hf.evaluation == 4 * n + generate_bytes(config, 3, 32, 16, 4.0)
    vllm = memory_estimate(_spec(model_dir, *fsdp, "sampler=vllm"), str(model_dir), cpu)
    assert vllm.evaluation == 4 * 256 * 64  # online with vLLM: the engine evaluates, nothing generates in torch
    single = memory_estimate(_spec(model_dir, "data=online", "sampler=hf", "eval.batch_size=3"), str(model_dir), cpu)
    assert single.evaluation == generate_bytes(config, 3, 32, 16, 4.0)  # one process: nothing to gather


def _offline_tis(model_dir, data, behaviour):
    """correction=tis on offline GRPO groups whose card (cli/sample.py) names the model that sampled them."""
    import json

    from humanline_cli.train.build import behaviour_of

    data.mkdir()
    (data / "card.json").write_text(json.dumps({"model_path": str(behaviour)}))
    spec = _spec(model_dir, "data=offline", f"data.path={data}", "correction=tis")
    return spec, behaviour_of(spec)


def test_offline_data_of_an_earlier_policy_counts_that_policy(model_dir, tmp_path):
    """train/behaviour.py loads the policy that generated the data (a model other than the start) whole, frozen,
    in the weights' dtype, for the run's whole length: fp32 here, 4 bytes a parameter, in every phase's peak.
    Its config: embeddings and head 256 x 32 each (8,192 + 8,192), one layer of q, k, v, o 32 x 32 (4,096),
    gate, up, down 32 x 64 (6,144) and two norms (64), the final norm (32): 26,720 parameters, 106,880 bytes."""
    from transformers import LlamaConfig

    from humanline_cli.train.fit import memory_estimate

    earlier = tmp_path / "earlier"
    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                head_dim=16).save_pretrained(earlier)
    cpu = torch.device("cpu")
    spec, behaviour = _offline_tis(model_dir, tmp_path / "groups", earlier)
    assert behaviour == str(earlier)
    without = memory_estimate(spec, str(model_dir), cpu)
    est = memory_estimate(spec, str(model_dir), cpu, behaviour=behaviour)
    assert est.reward - without.reward == 106_880.0
    assert (est.training - without.training, est.loading - without.loading) == (106_880.0, 106_880.0)
    # sampled by the run's own starting policy: the fixed reference serves the log-probs, nothing more loads
    spec, own = _offline_tis(model_dir, tmp_path / "own", model_dir)
    assert memory_estimate(spec, str(model_dir), cpu, behaviour=own).total == without.total
