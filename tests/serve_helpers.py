"""A real ``dsv4 serve`` process, for the tests that talk to one over HTTP."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dsv4.parallel import free_port

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def serve_process(args: list[str], env: dict, log_path, start_s: float = 180):
    """Run ``python -m dsv4.cli serve *args --host 127.0.0.1 --port <free port>`` (a later flag
    replaces an earlier one) with stdout and stderr in ``log_path``; yield ``(process, base url)``
    once ``/health`` answers 200; terminate it afterwards. Raises with the log when the server
    exits or is not up within ``start_s`` seconds."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dsv4.cli", "serve", *args, "--host", "127.0.0.1",
                                 "--port", str(port)], cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + start_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}:\n{Path(log_path).read_text()}")
                try:
                    if httpx.get(base + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not come up:\n{Path(log_path).read_text()}")
                time.sleep(0.3)
            yield proc, base
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
