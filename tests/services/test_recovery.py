"""Lost features are recomputed and lost KV is prefilled again: killed instances lose no request."""

from __future__ import annotations

import os
import signal
import threading
import time

from tests.services.conftest import client_for, start
from tests.services.test_behaviour import instances, metric
from tests.services.test_e2e import user_message


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
            deadline = time.monotonic() + 20
            while (
                metric(prefill["http_address"], "trident_prefills_total") < 2 and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            time.sleep(0.5)  # the decode task is published right after the prefill
            os.kill(pid_of(prefill), signal.SIGKILL)  # its KV goes with it
            cluster.start("prefill-new", "services.worker", TRIDENT_ROLES="prefill")
        finally:
            os.kill(pid_of(decode), signal.SIGCONT)
        thread.join(120)
        assert answer == [expected]
        assert metric(decode["http_address"], "trident_kv_pull_failures_total") == 1


def test_sigterm_drains_a_decoder_mid_stream(tiny_model_dir, tmp_path_factory):
    """SIGTERM: stop pulling, finish what is held, deregister, exit 0 — the stream is not cut."""
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
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 5:
                os.kill(pid_of(decode), signal.SIGTERM)
        assert chunks[-1].usage.completion_tokens == 400
        proc = next(p for name, p in cluster.procs.items() if name.startswith("decode"))
        assert proc.wait(30) == 0
        assert instances(cluster, "decode") == []
