"""Lost features are recomputed and lost KV is prefilled again: killed instances lose no request."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from common.roles import Role
from tests.deploy import running_cluster
from tests.services.conftest import client_for, start
from tests.services.test_behaviour import instances, metric
from tests.services.test_e2e import user_message

# Long enough that the request is still decoding when its decoder is stopped: the client reads
# behind the decoder, and tiny decodes 400 tokens in well under a second on a fast machine, which
# let a drain between two SIGTERMs finish the request by itself (nothing left to resume).
LONG = 1500


def pid_of(instance: dict) -> int:
    return int(instance["instance_id"].rsplit("-", 1)[1])


def ask(cluster, urls, text="Describe it", max_tokens=12):
    client = client_for(cluster)
    reply = client.chat.completions.create(
        model="tiny-llava", messages=user_message(urls, text), max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].message.content


def test_features_of_a_dead_encoder_are_recomputed_elsewhere(tiny_model_dir, tmp_path_factory, image_urls):
    with start(tiny_model_dir, tmp_path_factory, "e+p+d", {"encoder": 2}) as cluster:
        while len(instances(cluster, "encode")) < 2:
            time.sleep(0.2)
        first = ask(cluster, image_urls[:1])
        encoders = instances(cluster, "encode")
        owner = next(e for e in encoders if metric(e["http_address"], "trident_images_encoded_total") == 1)
        other = next(e for e in encoders if e is not owner)
        os.kill(pid_of(owner), signal.SIGKILL)
        # The feature index still names the dead encoder: prefill fails to pull, sends it back.
        assert ask(cluster, image_urls[:1]) == first
        assert metric(other["http_address"], "trident_images_encoded_total") == 1
        (prefill,) = instances(cluster, "prefill")
        assert metric(prefill["http_address"], "trident_feature_fetch_failures_total") == 1


def test_kv_of_a_dead_prefill_instance_is_prefilled_again(tiny_model_dir, tmp_path_factory):
    # ~400 prompt tokens: 400 KB of KV for tiny's 4 layers, past the 256 KB that rides inline in
    # the decode task, so decode must pull it from the prefill instance.
    story = "Tell me about the sea and the boats that sail on it at night. " * 30
    with start(tiny_model_dir, tmp_path_factory, "e+p+d") as cluster:
        expected = ask(cluster, [], story, 16)
        (decode,) = instances(cluster, "decode")
        (prefill,) = instances(cluster, "prefill")
        os.kill(pid_of(decode), signal.SIGSTOP)  # frozen: the decode task waits in the queue
        answer: list[str] = []
        thread = threading.Thread(target=lambda: answer.append(ask(cluster, [], story, 16)))
        thread.start()
        try:
            # Prefilled, and the decode task published (it waits for the frozen decoder): the KV
            # it names lives only in the prefill instance now.
            deadline = time.monotonic() + 20
            while cluster.unacked_tasks(Role.DECODE) < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            os.kill(pid_of(prefill), signal.SIGKILL)  # its KV goes with it
            cluster.start("prefill-new", "services.worker", TRIDENT_ROLES="prefill")
        finally:
            os.kill(pid_of(decode), signal.SIGCONT)
        thread.join(120)
        assert answer == [expected]
        assert metric(decode["http_address"], "trident_kv_pull_failures_total") == 1


def test_sigterm_drains_a_decoder_mid_stream(tiny_model_dir, tmp_path_factory):
    """SIGTERM: stop pulling, finish what is held, deregister, exit 0 — the stream is not cut, and
    the instance answers /ready (503, draining) and /metrics until it leaves."""
    with start(tiny_model_dir, tmp_path_factory, "e+p+d") as cluster:
        (decode,) = instances(cluster, "decode")
        stream = client_for(cluster).chat.completions.create(
            model="tiny-llava",
            messages=user_message([], "a long story"),
            max_tokens=400,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks, while_draining = [], []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 5:
                os.kill(pid_of(decode), signal.SIGTERM)
            if len(chunks) == 20:  # early: a client behind the stream must still find it draining
                while_draining.append(httpx.get(decode["http_address"] + "/ready", timeout=5).status_code)
                while_draining.append(metric(decode["http_address"], "trident_held_requests"))
        assert chunks[-1].usage.completion_tokens == 400
        assert while_draining == [503, 1]
        name, proc = next((n, p) for n, p in cluster.procs.items() if n.startswith("decode"))
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the decoder was still running 30 s after its stream ended:\n{cluster.log(name)[-3000:]}"
            )
        assert code == 0, cluster.log(name)[-3000:]
        assert instances(cluster, "decode") == []


@pytest.mark.parametrize(
    ("method", "scale", "stop"),
    [
        ("e+p+d", {"decode": 2}, "kill"),
        ("epd", {"worker-epd": 2}, "kill"),
        ("e+p+d", {"decode": 2}, "term-twice"),
    ],
)
def test_a_request_whose_decoder_dies_resumes_from_the_tokens_the_client_has(
    tiny_model_dir, tmp_path, image_urls, method, scale, stop
):
    """The instance decoding a streamed request is killed (or told twice to stop, which gives its
    held tasks back at once): the task is redelivered, the request is prefilled again over its
    prompt and the tokens already streamed (the gateway's journal), and decoding goes on elsewhere.
    Seeded sampling makes the uninterrupted answer the oracle: a resume from anything but exactly
    the streamed tokens, or a repeat of them, would change the text."""
    role = "decode"
    with running_cluster(tiny_model_dir, tmp_path, method, scale, {"TRIDENT_TASK_ACK_WAIT": "3"}) as cluster:
        deadline = time.monotonic() + 30
        while len(instances(cluster, role)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(instances(cluster, role)) == 2
        client = client_for(cluster)
        ask = dict(
            model="tiny-llava", messages=user_message(image_urls[:1], "Tell me a long story"),
            max_tokens=LONG, temperature=1.0, top_p=0.9, seed=11, extra_body={"ignore_eos": True},
        )  # fmt: skip
        expected = client.chat.completions.create(**ask).choices[0].message.content
        stream = client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
        pieces, killed, usage = [], None, None
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
            if len(pieces) == 20 and killed is None:
                killed = next(i for i in instances(cluster, role) if held(i) == 1)
                if stop == "kill":
                    os.kill(pid_of(killed), signal.SIGKILL)
                else:
                    os.kill(pid_of(killed), signal.SIGTERM)
                    draining(killed)  # the second signal is a second one, not merged into the first
                    os.kill(pid_of(killed), signal.SIGTERM)
        assert killed is not None
        assert "".join(pieces) == expected
        assert usage.completion_tokens == LONG
        survivors = [i for i in instances(cluster, role) if i["instance_id"] != killed["instance_id"]]
        assert sum(metric(i["http_address"], "trident_resumed_tokens_total") for i in survivors) >= 19
        if stop == "term-twice":
            proc = next(p for p in cluster.procs.values() if p.pid == pid_of(killed))
            assert proc.wait(10) == 0


def draining(instance: dict, timeout: float = 10.0) -> None:
    """Wait until the instance says it drains (its /ready answers 503) or is gone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(instance["http_address"] + "/ready", timeout=5).status_code == 503:
                return
        except httpx.HTTPError:
            return
        assert time.monotonic() < deadline, f"{instance['instance_id']} did not start draining"
        time.sleep(0.02)


def held(instance: dict) -> float:
    return metric(instance["http_address"], "trident_held_requests")
