"""The engine core in its own process (the default on CUDA), on a GPU: a check, not a benchmark.

1. SIGKILL of the core during 8 streams: each ends with an in-band error, the supervisor restarts the core
   (/health 200 again), 4 new requests complete.
2. SIGTERM to the whole process group during 16 streams of 400 tokens: every stream completes, exit code 0.

On a machine without CUDA it runs the same on the CPU with a 2-layer model (engine_process=on).

    PYTHONPATH=.site:. python3 benchmarks/gpu_core_check.py      # needs .tok (docs/gpu.md, GPU-MACHINE recipe)
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode import SHAPES, build_model  # noqa: E402

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]

def wait_health(url, proc, timeout):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("not healthy")

def stream(url, max_tokens, out, i):
    body = {"model": "m", "prompt": "hello world " * 20, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    toks, err, finish = 0, None, None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                err = f"HTTP {r.status_code}"
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    err = d["error"].get("message", "")[:120]
                if d.get("usage"):
                    toks = d["usage"]["completion_tokens"]
                for c in d.get("choices") or []:
                    finish = c.get("finish_reason") or finish
    except httpx.HTTPError as e:
        err = f"{type(e).__name__}: {e}"[:120]
    out[i] = {"tokens": toks, "finish": finish, "error": err}

def run_streams(url, n, max_tokens):
    out, threads = {}, []
    for i in range(n):
        t = threading.Thread(target=stream, args=(url, max_tokens, out, i)); t.start(); threads.append(t)
    return out, threads

def core_pid(server_pid):
    """The server's child that runs spawn_main (the engine core), not multiprocessing's resource tracker."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == server_pid and "spawn_main" in cmd and "resource_tracker" not in cmd:
                return int(d.name)
    return None

def main():
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        cuda = torch.cuda.is_available()
        SHAPES["small-49k"] = dict(SHAPES["llama-3.2-1b"], vocab_size=49152) if cuda else dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0)
        build_model("small-49k", torch.bfloat16 if cuda else torch.float32, model, torch.device("cuda" if cuda else "cpu"))
        for f in Path(".tok").iterdir():
            shutil.copy(f, model / f.name)
        port = free_port(); url = f"http://127.0.0.1:{port}"
        log = open(os.environ.get("OUT", tmp) + "/core_check_server.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "cllm", "serve", "--backend", "torch", "--model", str(model),
                                 "--port", str(port), "--served-model-name", "m",
                                 *([] if cuda else ["--set", "engine_process=on"])], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            res["ready_s"] = wait_health(url, proc, 300)
            res["engine_before"] = httpx.get(url + "/v1/engine", timeout=5).json()
            # 1. kill -9 the core mid-stream
            out, threads = run_streams(url, 8, 3000)
            time.sleep(2.0)
            pid = core_pid(proc.pid); res["core_pid"] = pid
            os.kill(pid, signal.SIGKILL); t_kill = time.monotonic()
            for t in threads: t.join()
            res["killed_streams"] = out
            res["restart_s"] = wait_health(url, proc, 300)
            res["engine_after_restart"] = {k: v for k, v in httpx.get(url + "/v1/engine", timeout=5).json().items()
                                           if "restart" in k or k in ("running", "waiting", "num_running", "num_waiting")}
            out2, th2 = run_streams(url, 4, 64)
            for t in th2: t.join()
            res["after_restart_streams"] = out2
            # 2. SIGTERM to the process group mid-stream: every stream must complete
            out3, th3 = run_streams(url, 16, 400)
            time.sleep(1.5)
            os.killpg(proc.pid, signal.SIGTERM)
            for t in th3: t.join()
            res["sigterm_streams"] = out3
            res["exit_code"] = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    ok_kill = all(v["error"] for v in res["killed_streams"].values())
    ok_after = all(v["tokens"] == 64 and not v["error"] for v in res["after_restart_streams"].values())
    ok_term = all(v["tokens"] == 400 and v["finish"] == "length" and not v["error"] for v in res["sigterm_streams"].values())
    res["verdict"] = {"killed_streams_all_failed": ok_kill, "after_restart_all_ok": ok_after,
                      "sigterm_all_completed": ok_term, "exit_0": res["exit_code"] == 0}
    print(json.dumps(res, indent=1, default=str))
    Path(os.environ.get("OUT", ".")).joinpath("core_check.json").write_text(json.dumps(res, indent=1, default=str))

if __name__ == "__main__":
    main()
