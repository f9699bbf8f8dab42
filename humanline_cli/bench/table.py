"""The console table of a `humanline bench` result: a row per system, then the ratios between them."""
from __future__ import annotations

NAMES = {"project": "humanline (plain)", "project_cached": "humanline (plain, reference cached)",
         "project_humanline": "humanline (+humanline)", "trl": "TRL", "trl_cached": "TRL (precompute_ref_log_probs)"}


def print_result(res: dict, console) -> None:
    import pandas as pd

    unit = res["unit"]
    console.print(f"humanline bench: {res['objective']} ({res['regime']}) on {res['task']}/{res['model']} "
                  f"({res['params'] / 1e6:.2f}M params), {res['device']} {res['precision']}, {res['threads']} threads, "
                  f"batch {res['batch_size']} {unit}, {res['steps']} steps x {res['repeats']}", markup=False)
    bf16 = " (bf16=True)" if res["precision"] == "bfloat16" else ""  # TRL's rows compute as ours do
    table = pd.DataFrame([{"system": NAMES[k] + (bf16 if k.startswith("trl") else ""),
                           f"{unit}/s": f"{r['units_per_s']:.1f}", "steps/s": f"{r['steps_per_s']:.3f}",
                           "tokens/s": f"{r['tokens_per_s']:.0f}", "step ms": f"{1e3 * r['step_s']:.1f}",
                           "model GFLOP/s": f"{r['flops_per_s'] / 1e9:.2f}", "% of matmul peak": f"{100 * r['mfu']:.1f}",
                           "% (positions run)": f"{100 * r['run_mfu']:.1f}" if "run_mfu" in r else "-",
                           **({"% of fp32 peak": f"{100 * r['mfu_fp32']:.1f}"} if "mfu_fp32" in r else {})}
                          for k, r in res["rows"].items()])
    console.print(table.to_string(index=False), markup=False, highlight=False)
    mp = res["matmul_peak"]
    lines = [f"matmul peak ({mp['m']}x{mp['k']} @ {mp['k']}x{mp['n']} {mp['dtype']}): "
             f"{mp['flops_per_s'] / 1e9:.1f} GFLOP/s"
             + (f"; fp32 {res['fp32_matmul_peak'] / 1e9:.1f} GFLOP/s" if res.get("fp32_matmul_peak") else "")]
    if res.get("precision_why"):
        lines.append(f"precision: {res['precision_why']}")
    if res["humanline_overhead"] is not None:
        lines.append(f"humanline overhead (step time +humanline / plain): {res['humanline_overhead']:.3f}x")
    if res["regime"] == "online" and res["trl_steps_ratio"] is not None:
        lines.append(f"online GRPO vs TRL GRPOTrainer.train (project steps/s / TRL steps/s): "
                     f"{res['trl_steps_ratio']:.2f}x")
    elif res["trl_ratio"] is not None:
        lines.append(f"throughput vs TRL (project {unit}/s / TRL {unit}/s): plain {res['trl_ratio']:.2f}x, "
                     f"+humanline {res['trl_humanline_ratio']:.2f}x")
    if res["cache_speedup"] is not None:
        lines.append(f"reference cache (plain step / cached step, epochs after the first): {res['cache_speedup']:.2f}x")
    if res["trl_cached_ratio"] is not None:
        lines.append(f"cached reference vs TRL precompute_ref_log_probs ({unit}/s): {res['trl_cached_ratio']:.2f}x")
    if res["trl_note"]:
        lines.append(f"note: {res['trl_note']}")
    s = res.get("sampler")
    if s:
        mfu = {k: f" ({v['mfu']:.1%} of the matmul peak)" if "mfu" in v else "" for k, v in s.items()
               if isinstance(v, dict)}
        v = s["vllm"]
        lines.append(f"sampler on {s['prompts']} prompts: HF generate {s['hf']['tokens_per_s']:.0f} tokens/s{mfu['hf']}"
                     + (f", vLLM {v['tokens_per_s']:.0f} tokens/s{mfu['vllm']} (+{v['startup_s']:.1f} s start-up)"
                        if "error" not in v else f", vLLM unavailable: {v['error']}"))
    for line in lines:
        console.print(line, markup=False, highlight=False)
