"""The console table of a `humanline bench` result (rows per system, ratios vs TRL, the cache speedup,
the humanline overhead, the sampler line)."""
from __future__ import annotations


def print_result(res: dict, console) -> None:
    from rich.table import Table

    unit = res["unit"]
    t = Table(title=f"humanline bench: {res['objective']} on {res['task']}/{res['model']} "
                    f"({res['params'] / 1e6:.2f}M params), {res['device']} {res['precision']}, "
                    f"{res['threads']} threads, batch {res['batch_size']} {unit}, {res['steps']} steps x {res['repeats']}")
    for col in ("system", f"{unit}/s", "tokens/s", "step ms", "model GFLOP/s", "% of matmul peak"):
        t.add_column(col, justify="right" if col != "system" else "left")
    names = {"project": "humanline (plain)", "project_cached": "humanline (plain, reference cached)",
             "project_humanline": "humanline (+humanline)", "trl": "TRL",
             "trl_cached": "TRL (precompute_ref_log_probs)"}
    for key, row in res["rows"].items():
        t.add_row(names[key], f"{row['units_per_s']:.1f}", f"{row['tokens_per_s']:.0f}", f"{1e3 * row['step_s']:.1f}",
                  f"{row['flops_per_s'] / 1e9:.2f}", f"{100 * row['mfu']:.1f}")
    console.print(t)
    mp = res["matmul_peak"]
    console.print(f"matmul peak ({mp['m']}x{mp['k']} @ {mp['k']}x{mp['n']} {mp['dtype']}): "
                  f"{mp['flops_per_s'] / 1e9:.1f} GFLOP/s")
    console.print(f"humanline overhead (step time +humanline / plain): {res['humanline_overhead']:.3f}x")
    if res["trl_ratio"] is not None:
        console.print(f"throughput vs TRL (project {unit}/s / TRL {unit}/s): plain {res['trl_ratio']:.2f}x, "
                      f"+humanline {res['trl_humanline_ratio']:.2f}x")
    if res.get("cache_speedup") is not None:
        console.print(f"reference cache (plain step / cached step, epochs after the first): "
                      f"{res['cache_speedup']:.2f}x")
    if res.get("trl_cached_ratio") is not None:
        console.print(f"cached reference vs TRL precompute_ref_log_probs ({unit}/s): {res['trl_cached_ratio']:.2f}x")
    if res["trl_note"]:
        console.print(f"note: {res['trl_note']}", markup=False)
    s = res.get("sampler")
    if s:
        line = (f"sampler on {s['prompts']} prompts: HF generate {s['hf']['tokens_per_s']:.0f} tokens/s"
                f"{_mfu(s['hf'])}")
        v = s["vllm"]
        line += (f", vLLM {v['tokens_per_s']:.0f} tokens/s{_mfu(v)} (+{v['startup_s']:.1f} s start-up)"
                 if "error" not in v else f", vLLM unavailable: {v['error']}")
        console.print(line, markup=False)


def _mfu(got: dict) -> str:
    """Decoding's share of the measured matmul peak (2 P FLOPs per token), when the bench computed it."""
    return f" ({got['mfu']:.1%} of the matmul peak)" if "mfu" in got else ""
