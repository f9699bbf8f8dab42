"""Rank-0-only work longer than backend.timeout_s does not trip the training group's timeout: the other
ranks wait for it in a barrier of a separate gloo group with a long timeout (backend.wait_for_rank0).
Two gloo ranks with backend.timeout_s=5 and an API judge (judge=llm, a local stub server) whose first
answer takes 10 s: rank 1 waits for rank 0's judging, the run completes."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers.cli import FAST, TINY_WORLD, run_cli

SLOW_S = 10.0


class SlowJudge:
    """An OpenAI-compatible chat endpoint answering "A" (the first output wins), the first request after
    SLOW_S seconds, the rest at once; records when each request arrived."""

    def __init__(self):
        self.arrived: list[float] = []
        lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    judge.arrived.append(time.monotonic())
                    first = len(judge.arrived) == 1
                if first:
                    time.sleep(SLOW_S)
                body = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "slow",
                                   "choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant", "content": "A"}}],
                                   "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_a_rank0_judge_slower_than_the_collective_timeout_completes(cache_dir, tmp_path):
    judge = SlowJudge()
    run = tmp_path / "run"
    try:
        r = run_cli(["train", *TINY_WORLD, *FAST, "objective=dpo", "backend=cpu", "backend.strategy=ddp",
                     "backend.nproc=2", "backend.timeout_s=5", "judge=llm", f"judge.base_url={judge.url}",
                     "judge.model=slow", f"judge.cache_dir={tmp_path / 'judgments'}", "judge.max_concurrency=1",
                     "eval.n_prompts=4", f"hydra.run.dir={run}"], tmp_path, timeout=1500)  # a fresh world: minutes
    finally:
        judge.close()
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "complete"
    # 4 prompts judged in both orders, one request at a time: the first took SLOW_S, longer than the timeout
    # (at most 8 requests: a pair whose two completions are the same text is one slot in both orders, one request)
    assert 2 <= len(judge.arrived) <= 8 and judge.arrived[1] - judge.arrived[0] >= SLOW_S
    # "A" always wins: in one order the trained reply, in the other the starting one: every pair a tie
    assert s["eval"]["win_rate"] == 0.5 and s["eval"]["judge_usage"]["n_calls"] == len(judge.arrived)
