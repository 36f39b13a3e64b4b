"""`trident bench compare`'s deployments: started, serving, and gone afterwards."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import pytest

from common.infra import free_port
from trident.bench import deployments
from trident.bench.deployments import PEER, TRIDENT, Served
from trident.launcher.local_up import UpCommand
from trident.launcher.state import is_alive

WORKERS = ("encoder", "prefill", "decode")  # compose.yaml's services for e+p+d


def served(kind: str) -> Served:
    return Served("x", kind, "http://127.0.0.1:1", "m", 1, Path("."))


def test_each_server_is_asked_for_exactly_max_tokens_its_own_way():
    body = {"model": "m", "messages": [], "max_tokens": 7}
    assert served(TRIDENT).ignoring_eos(body) == {**body, "ignore_eos": True}
    # transformers serve answers 422 to `ignore_eos`; min_new_tokens masks EOS up to max_tokens.
    peer = served(PEER).ignoring_eos(body)
    assert "ignore_eos" not in peer and json.loads(peer["generation_config"]) == {"min_new_tokens": 7}
    assert body == {"model": "m", "messages": [], "max_tokens": 7}  # not changed in place


def ask(s: Served) -> dict:
    body = {"model": s.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    url = f"{s.url}/v1/chat/completions"
    answer = httpx.post(url, json=s.ignoring_eos(body), timeout=120, trust_env=False)
    assert answer.status_code == 200, answer.text
    return answer.json()


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


@pytest.mark.slow
def test_trident_up_serves_with_the_callers_environment_and_leaves_nothing(tiny_model_dir, tmp_path):
    env = {"TRIDENT_POLICY": "decode-first", "TRIDENT_PREFETCH": "0", "TRIDENT_KV_LAYER_GROUP": "1"}
    with deployments.trident(UpCommand(tiny_model_dir, tmp_path, "e+p+d", env=env, port=free_port())) as s:
        assert s.model == "tiny-llava" and ask(s)["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{s.planner_url}/health", timeout=5, trust_env=False).status_code == 200
        state = json.loads((tmp_path / ".trident" / "up.json").read_text())
        records = [*state["processes"], *state["servers"].values()]
        workers = [p for p in state["processes"] if p["name"].rsplit("-", 1)[0] in WORKERS]
        assert len(workers) == 3
        for worker in workers:  # compose.yaml sets none of these: the caller's values reach every worker
            assert {k: environ(worker["pid"]).get(k) for k in env} == env
    assert not any(is_alive(r) for r in records)
    assert not (tmp_path / ".trident" / "up.json").exists()


NO_ACCELERATE = importlib.util.find_spec("accelerate") is None


@pytest.mark.slow
@pytest.mark.skipif(NO_ACCELERATE, reason="transformers serve needs accelerate (pip install -e '.[bench]')")
def test_transformers_serve_answers_our_checkpoint_and_stops(tiny_model_dir, tmp_path):
    with deployments.transformers_serve(tiny_model_dir, port=free_port(), log_dir=tmp_path) as s:
        assert ask(s)["usage"]["completion_tokens"] == 4
        pid = s.pid
    assert not Path(f"/proc/{pid}").exists()
