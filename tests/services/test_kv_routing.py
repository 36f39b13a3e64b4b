"""Routing by cached prefix in a deployment (e+p+d, two prefill instances): a request goes to the
prefill instance that holds its prompt's prefix, and computes only the rest; a restarted gateway
learns where prefixes live again from the instances' snapshots; and a request sent to a holder that
was just killed still ends, with HF's answer, taken back to the shared queue within the bound.

On the E+P+D deployment with two of each stage that the fault tests strike (tests/helpers/faults.py),
made whole before each test and after it (the killed holder restarted): its own preamble and picture,
which no other module sends, keep what others cached out of its prefixes, and what a test counts is
what this module's requests added."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch

from tests.helpers.announcements import Announcements
from tests.helpers.chat import PREAMBLE, client_for
from tests.helpers.deployments import shared
from tests.helpers.faults import TWO_OF_EACH, heal, healed
from tests.helpers.images import data_url, make_image
from tests.helpers.probes import instances, metric, prefix_routes, read_store, wait_for

MAX_TOKENS = 8
# A preamble of this module's own: other modules' prompts share no block with it (PREAMBLE's first
# blocks may be cached on either prefill instance by whatever ran on the deployment before). Its
# words are one block of tiny-llava's tokens (16) exactly: the questions start where they did after
# PREAMBLE alone, so "all but the question" is cached as it was.
OWN_PREAMBLE = "Routing requests by a prefix. " + PREAMBLE
PICTURE = 460  # an image no other module sends: no encoder or feature store has it yet
FIRST = "Where does the fox sleep?"  # this module's first question
FIRST_ANSWER = "In a den."  # what a client would send back as the first turn's answer


def messages(question: str, image: int | None = None) -> list[dict]:
    """The preamble and a question; with `image`, a second turn after the first answer, asking about
    that test image (a turn that adds an image: the request is encoded first, and its prefix is the
    cached first turn — LLaVA's template puts a message's images before its text)."""
    if image is None:
        return [{"role": "user", "content": OWN_PREAMBLE + question}]
    picture = {"type": "image_url", "image_url": {"url": data_url(make_image(image))}}
    return [
        {"role": "user", "content": OWN_PREAMBLE + FIRST},
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


two_of_each = shared(TWO_OF_EACH)


@pytest.fixture(scope="module")
def baseline(two_of_each) -> dict[str, dict[str, float]]:
    """What the instances had counted before this module's first request, by metric and instance
    id (a restarted instance, under a new id, counts from 0)."""
    heal(two_of_each)  # every worker registered, whatever the module before left
    names = ("trident_prefills_total", "trident_mailbox_tasks_total")
    return {n: {i: metric(p["http_address"], n) for i, p in prefills(two_of_each).items()} for n in names}


@pytest.fixture
def two_prefills(two_of_each, baseline):
    """Two prefill instances (and two of each other stage), whole before the test and after it."""
    yield from healed(two_of_each)


def since(baseline: dict, name: str, instance: dict) -> float:
    """`name` on `instance`, less what it had counted before this module."""
    return metric(instance["http_address"], name) - baseline[name].get(instance["instance_id"], 0.0)


def holder_of_one_prefill(cluster, baseline: dict) -> dict:
    """The prefill instance that has run a prefill since this module began (its first request)."""
    ran = [i for i in prefills(cluster).values() if since(baseline, "trident_prefills_total", i) > 0]
    assert len(ran) == 1, ran
    return ran[0]


def test_a_request_goes_to_the_instance_that_holds_its_prefix(two_prefills, baseline, hf_tiny):
    cluster = two_prefills
    routed = prefix_routes(cluster, "prefix")
    with Announcements(cluster) as heard:
        sent = time.monotonic()
        first = ask(cluster, FIRST)
        answered = time.monotonic()
        assert first.choices[0].message.content == hf_answer(hf_tiny, FIRST)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        prompt_tokens = first.usage.prompt_tokens
        holder = holder_of_one_prefill(cluster, baseline)
        # What the gateway indexes it by (its index's size says nothing here: others' keys are in it).
        heard.wait_gained(
            holder["instance_id"], sent, answered, "the holder announcing the first prompt's blocks"
        )
    for i, question in enumerate(["What does the fox eat?", "Is the dog lazy?", "How fast is it?"], 1):
        reply = ask(cluster, question)
        assert reply.choices[0].message.content == hf_answer(hf_tiny, question)
        assert reply.usage.prompt_tokens_details.cached_tokens >= prompt_tokens - 32  # all but the question
        assert prefix_routes(cluster, "prefix") == routed + i
        assert since(baseline, "trident_mailbox_tasks_total", holder) == i
    others = [p for p in prefills(cluster).values() if p["instance_id"] != holder["instance_id"]]
    assert [since(baseline, "trident_prefills_total", p) for p in others] == [0]
    # The planner's trace says what the cache spared, so its simulator does not compute it again.
    wait_for(lambda: traced(cluster, reply.id) is not None, what="the last request's trace entry")
    assert traced(cluster, reply.id).cached_tokens == reply.usage.prompt_tokens_details.cached_tokens


def traced(cluster, rid: str):
    found = [t for _, t in read_store(cluster, lambda s: s.requests.trace()) if t.request_id == rid]
    return found[0] if found else None


def test_a_request_encoded_first_is_sent_on_to_the_holder_by_its_encoder(two_prefills, baseline, hf_tiny):
    cluster = two_prefills
    holder = holder_of_one_prefill(cluster, baseline)
    before = metric(holder["http_address"], "trident_mailbox_tasks_total")
    routed = prefix_routes(cluster, "prefix")
    encoders = instances(cluster, "encode")
    encoded = sum(metric(e["http_address"], "trident_images_encoded_total") for e in encoders)
    question = "And what is in this picture?"
    reply = ask(cluster, question, image=PICTURE)
    assert reply.choices[0].message.content == hf_answer(hf_tiny, question, image=PICTURE)
    assert reply.usage.prompt_tokens_details.cached_tokens > 0
    assert prefix_routes(cluster, "prefix") == routed + 1
    assert metric(holder["http_address"], "trident_mailbox_tasks_total") == before + 1
    assert sum(metric(e["http_address"], "trident_images_encoded_total") for e in encoders) >= encoded + 1


def test_a_restarted_gateway_learns_where_prefixes_live(two_prefills, baseline, hf_tiny):
    cluster = two_prefills
    holder = holder_of_one_prefill(cluster, baseline)
    with Announcements(cluster) as heard:
        cluster.stop("gateway")
        cluster.start("gateway", "services.gateway")
        cluster.wait_ready()
        # The holder's own snapshot, not the first of any instance's: the others hold keys too.
        heard.wait_snapshot(
            holder["instance_id"], time.monotonic(), "the holder's snapshot after the restart"
        )
    wait_for(lambda: metric(cluster.url, "trident_gateway_prefix_index_keys") > 0,
             what="a snapshot reaching the new gateway")  # fmt: skip
    before = metric(holder["http_address"], "trident_mailbox_tasks_total")
    reply = ask(cluster, "Who is quick?")
    assert reply.choices[0].message.content == hf_answer(hf_tiny, "Who is quick?")
    assert prefix_routes(cluster, "prefix") == 1
    assert metric(holder["http_address"], "trident_mailbox_tasks_total") == before + 1


def test_a_request_sent_to_a_killed_holder_still_ends_with_the_answer(two_prefills, baseline, hf_tiny):
    """Killed just before the request: the gateway still lists it, sends the request there, and
    takes it back to the shared queue after TRIDENT_KV_ROUTING_TAKE_BACK (or the failover hands it
    on first); the other prefill instance computes it. (Restarted after the test, as every victim.)"""
    cluster = two_prefills
    holder = holder_of_one_prefill(cluster, baseline)
    routed = prefix_routes(cluster, "prefix")
    pid = int(holder["instance_id"].rsplit("-", 1)[1])
    os.kill(pid, signal.SIGKILL)
    began = time.monotonic()
    reply = ask(cluster, "Is the fox still there?")
    assert reply.choices[0].message.content == hf_answer(hf_tiny, "Is the fox still there?")
    assert time.monotonic() - began < 20
    found = httpx.get(cluster.url + "/metrics", timeout=5).text
    # Sent to the dead holder: the path under test.
    assert prefix_routes(cluster, "prefix") == routed + 1, found
