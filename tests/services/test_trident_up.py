"""`trident up` runs the real services from compose.yaml, serves, and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai

from common.infra import free_port

REPO = Path(__file__).resolve().parents[2]


def test_trident_up_serves_ep_plus_d_and_drains(tiny_model_dir, tmp_path):
    shutil.copy(REPO / "compose.yaml", tmp_path / "compose.yaml")
    port = free_port()
    trident = Path(sys.executable).with_name("trident")
    proc = subprocess.Popen(
        [str(trident), "up", "--model", str(tiny_model_dir), "--method", "ep+d", "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )
    try:
        url, seen = None, []
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            match = re.fullmatch(r"gateway: (http://\S+)\n", line)
            url = match.group(1) if match else None
        assert url == f"http://127.0.0.1:{port}", "".join(seen)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=tiny_model_dir.name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,
        )
        assert reply.usage.completion_tokens == 5
        assert (tmp_path / ".trident" / "logs").is_dir() and (tmp_path / ".trident" / "up.json").is_file()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
