"""Routing by cached prefix in a deployment (e+p+d, two prefill instances): a request goes to the
prefill instance that holds its prompt's prefix, and computes only the rest; a restarted gateway
learns where prefixes live again from the instances' snapshots; and a request sent to a holder that
was just killed still ends, with HF's answer, taken back to the shared queue within the bound."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch

from tests.deploy import running_cluster
from tests.helpers.chat import PREAMBLE, client_for
from tests.helpers.images import data_url, make_image
from tests.helpers.probes import instances, metric, prefix_routes, read_store, wait_for

MAX_TOKENS = 8
FIRST = "Where does the fox sleep?"  # the deployment's first question
FIRST_ANSWER = "In a den."  # what a client would send back as the first turn's answer


def messages(question: str, image: int | None = None) -> list[dict]:
    """The preamble and a question; with `image`, a second turn after the first answer, asking about
    that test image (a turn that adds an image: the request is encoded first, and its prefix is the
    cached first turn — LLaVA's template puts a message's images before its text)."""
    if image is None:
        return [{"role": "user", "content": PREAMBLE + question}]
    picture = {"type": "image_url", "image_url": {"url": data_url(make_image(image))}}
    return [
        {"role": "user", "content": PREAMBLE + FIRST},
        {"role": "assistant", "content": FIRST_ANSWER},
        {"role": "user", "content": [{"type": "text", "text": question}, picture]},
    ]


def hf_answer(hf_tiny, question: str, image: int | None = None) -> str:
    model, processor = hf_tiny
    chat = [
        {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
        if isinstance(m["content"], str)
        else {"role": m["role"], "content": [{"type": "text", "text": question}, {"type": "image"}]}
        for m in messages(question, image)
    ]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True)
    images = [make_image(image)] if image is not None else None
    enc = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def ask(cluster, question: str, image: int | None = None):
    return client_for(cluster).chat.completions.create(
        model="tiny-llava", messages=messages(question, image), max_tokens=MAX_TOKENS, temperature=0
    )


def prefills(cluster) -> dict[str, dict]:
    return {i["instance_id"]: i for i in instances(cluster, "prefill")}


def holder_of_one_prefill(cluster) -> dict:
    """The prefill instance that has run a prefill (the deployment's first request)."""
    ran = [i for i in prefills(cluster).values() if metric(i["http_address"], "trident_prefills_total") > 0]
    assert len(ran) == 1, ran
    return ran[0]


@pytest.fixture(scope="module")
def two_prefills(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("kvrouting")
    with running_cluster(tiny_model_dir, workdir, "e+p+d", {"prefill": 2}) as cluster:
        wait_for(lambda: len(prefills(cluster)) == 2, what="two prefill instances")
        yield cluster


def test_a_request_goes_to_the_instance_that_holds_its_prefix(two_prefills, hf_tiny):
    cluster = two_prefills
    first = ask(cluster, FIRST)
    assert first.choices[0].message.content == hf_answer(hf_tiny, FIRST)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    prompt_tokens = first.usage.prompt_tokens
    wait_for(lambda: metric(cluster.url, "trident_gateway_prefix_index_keys") >= prompt_tokens // 16 - 1,
             what="the gateway indexing the first prompt's blocks")  # fmt: skip
    holder = holder_of_one_prefill(cluster)
    for i, question in enumerate(["What does the fox eat?", "Is the dog lazy?", "How fast is it?"], 1):
        reply = ask(cluster, question)
        assert reply.choices[0].message.content == hf_answer(hf_tiny, question)
        assert reply.usage.prompt_tokens_details.cached_tokens >= prompt_tokens - 32  # all but the question
        assert prefix_routes(cluster, "prefix") == i
        assert metric(holder["http_address"], "trident_mailbox_tasks_total") == i
    others = [p for p in prefills(cluster).values() if p["instance_id"] != holder["instance_id"]]
    assert [metric(p["http_address"], "trident_prefills_total") for p in others] == [0]
    # The planner's trace says what the cache spared, so its simulator does not compute it again.
    wait_for(lambda: traced(cluster, reply.id) is not None, what="the last request's trace entry")
    assert traced(cluster, reply.id).cached_tokens == reply.usage.prompt_tokens_details.cached_tokens


def traced(cluster, rid: str):
    found = [t for _, t in read_store(cluster, lambda s: s.requests.trace()) if t.request_id == rid]
    return found[0] if found else None


def test_a_request_encoded_first_is_sent_on_to_the_holder_by_its_encoder(two_prefills, hf_tiny):
    cluster = two_prefills
    holder = holder_of_one_prefill(cluster)
    before = metric(holder["http_address"], "trident_mailbox_tasks_total")
    routed = prefix_routes(cluster, "prefix")
    reply = ask(cluster, "And what is in this picture?", image=2)
    assert reply.choices[0].message.content == hf_answer(hf_tiny, "And what is in this picture?", image=2)
    assert reply.usage.prompt_tokens_details.cached_tokens > 0
    assert prefix_routes(cluster, "prefix") == routed + 1
    assert metric(holder["http_address"], "trident_mailbox_tasks_total") == before + 1
    encoder = instances(cluster, "encode")[0]
    assert metric(encoder["http_address"], "trident_images_encoded_total") >= 1


def test_a_restarted_gateway_learns_where_prefixes_live(two_prefills, hf_tiny):
    cluster = two_prefills
    holder = holder_of_one_prefill(cluster)
    cluster.stop("gateway")
    cluster.start("gateway", "services.gateway")
    cluster.wait_ready()
    wait_for(lambda: metric(cluster.url, "trident_gateway_prefix_index_keys") > 0,
             what="a snapshot reaching the new gateway")  # fmt: skip
    before = metric(holder["http_address"], "trident_mailbox_tasks_total")
    reply = ask(cluster, "Who is quick?")
    assert reply.choices[0].message.content == hf_answer(hf_tiny, "Who is quick?")
    assert prefix_routes(cluster, "prefix") == 1
    assert metric(holder["http_address"], "trident_mailbox_tasks_total") == before + 1


def test_a_request_sent_to_a_killed_holder_still_ends_with_the_answer(two_prefills, hf_tiny):
    """Killed just before the request: the gateway still lists it, sends the request there, and
    takes it back to the shared queue after TRIDENT_KV_ROUTING_TAKE_BACK (or the failover hands it
    on first); the other prefill instance computes it."""
    cluster = two_prefills
    holder = holder_of_one_prefill(cluster)
    pid = int(holder["instance_id"].rsplit("-", 1)[1])
    os.kill(pid, signal.SIGKILL)
    began = time.monotonic()
    reply = ask(cluster, "Is the fox still there?")
    assert reply.choices[0].message.content == hf_answer(hf_tiny, "Is the fox still there?")
    assert time.monotonic() - began < 20
    (name,) = [n for n, p in cluster.procs.items() if p.pid == pid]
    cluster.procs.pop(name)
    found = httpx.get(cluster.url + "/metrics", timeout=5).text
    assert prefix_routes(cluster, "prefix") == 2, found  # sent to the dead holder: the path under test
