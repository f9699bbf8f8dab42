"""The lab: what we run to study our own tool, never what a user types. The cost model (predict, targets, speed,
paper_speed) and the measurement of its constants (constants), the GPU and memory checks (gpu_check, vllm_rows,
step_bench, memory_check, memory_runs), study figures (regime_map, frontier) and async_bench. Each module is a
script, `python -m humanline_cli.lab.NAME --help`, or a just recipe; it may import the product, and nothing in the
product imports it (tests/test_layout.py)."""
