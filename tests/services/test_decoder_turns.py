"""Decoder-side reuse (issue 26, point 3), in a deployment: a decode instance that continues
conversations (TRIDENT_DECODE_PREFILL_TOKENS) keeps the turns it decoded in its prefix cache and says
so; the gateway sends it the next turn, whose uncached rest it prefills itself — no prefill
instance runs and no KV moves — with HF's answer on the whole conversation.

On the E+P+D deployment with two of each stage that the fault tests strike (tests/helpers/faults.py),
its two decode instances replaced by one that continues conversations for this module and put back
after it; what the test counts is what its requests added. (Not the shared plain E+P+D: the continuing
decoder's profile, kept in Redis, would be one more than test_e2e.py finds there.)"""

from __future__ import annotations

import time

import pytest

from tests.helpers.announcements import Announcements
from tests.helpers.chat import PREAMBLE, client_for
from tests.helpers.deployments import shared
from tests.helpers.faults import TWO_OF_EACH, replaced_decoder
from tests.helpers.probes import instances, metric, prefix_routes

MAX_TOKENS = 8
two_of_each = shared(TWO_OF_EACH)


def chat(question: str, answer: str | None = None, follow_up: str | None = None) -> list[dict]:
    turns = [{"role": "user", "content": PREAMBLE + question}]
    if answer is not None:
        turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
    return turns


def hf_answer(hf_tiny, messages: list[dict]) -> str:
    import torch

    model, processor = hf_tiny
    conversation = [
        {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages
    ]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True)
    enc = processor(text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def continuing_decoder(two_of_each):
    """E+P+D whose one decode instance continues conversations, its plain decoders put back
    afterwards. (Compose's decode service, `python -m services.decode`, the setting from the
    environment.)"""
    with replaced_decoder(two_of_each, "decode-turns", TRIDENT_DECODE_PREFILL_TOKENS="256") as cluster:
        yield cluster


def test_the_next_turn_continues_on_the_decoder_that_holds_the_history(continuing_decoder, hf_tiny):
    cluster = continuing_decoder
    client = client_for(cluster)
    (decoder,) = instances(cluster, "decode")
    prefills = instances(cluster, "prefill")
    assert decoder["prefills_up_to"] == 256

    def prefilled() -> dict[str, float]:
        return {p["instance_id"]: metric(p["http_address"], "trident_prefills_total") for p in prefills}

    before, routed = prefilled(), prefix_routes(cluster, "decoder")

    first = chat("Where does the fox sleep?")
    with Announcements(cluster) as heard:
        sent = time.monotonic()
        one = client.chat.completions.create(
            model="tiny-llava", messages=first, max_tokens=MAX_TOKENS, temperature=0
        )
        answered = time.monotonic()
        answer = one.choices[0].message.content
        assert answer == hf_answer(hf_tiny, first)
        (prefill,) = [i for i, n in prefilled().items() if n > before[i]]  # the one that ran it
        # The decoder announces the turn's blocks (its prompt, imported, and its answer's), the
        # prefill instance the prompt's: what the gateway indexes them by (its index's size says
        # nothing here, other modules' keys are in it).
        for instance in (prefill, decoder["instance_id"]):
            heard.wait_gained(instance, sent, answered, f"{instance}'s blocks")
    second = chat("Where does the fox sleep?", answer or "ok", "And where does the dog sleep?")
    two = client.chat.completions.create(
        model="tiny-llava", messages=second, max_tokens=MAX_TOKENS, temperature=0
    )
    assert two.choices[0].message.content == hf_answer(hf_tiny, second)
    assert prefix_routes(cluster, "decoder") == routed + 1
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens - 16
    # The decoder ran the second turn's prefill; the prefill instances ran only the first turn's.
    assert metric(decoder["http_address"], "trident_prefills_total") == 1
    assert sum(prefilled().values()) == sum(before.values()) + 1
    assert metric(decoder["http_address"], "trident_mailbox_tasks_total") == 1


def test_the_cluster_view_says_which_decoders_continue_turns(continuing_decoder):
    found = continuing_decoder.instances()
    assert [i.get("prefills_up_to") for i in found if "decode" in i["roles"]] == [256]
