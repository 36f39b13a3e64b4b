"""Decoder-side reuse (issue 26, point 3), in a deployment: a decode instance that continues
conversations (TRIDENT_DECODE_PREFILL_TOKENS) keeps the turns it decoded in its prefix cache and says
so; the gateway sends it the next turn, whose uncached rest it prefills itself — no prefill
instance runs and no KV moves — with HF's answer on the whole conversation."""

from __future__ import annotations

import pytest

from tests.deploy import running_cluster
from tests.helpers.chat import PREAMBLE, client_for
from tests.helpers.probes import instances, metric, prefix_routes, wait_for

MAX_TOKENS = 8


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
def continuing_decoder(tiny_model_dir, tmp_path_factory):
    """E+P+D whose one decode instance continues conversations."""
    workdir = tmp_path_factory.mktemp("decoder-turns")
    with running_cluster(tiny_model_dir, workdir, "e+p+d") as cluster:
        # compose's decode service (`python -m services.decode`), the setting from the environment
        cluster.start("decode-turns", "services.decode", TRIDENT_DECODE_PREFILL_TOKENS="256")
        wait_for(lambda: len(instances(cluster, "decode")) == 2, what="the second decode instance")
        cluster.stop(cluster.name_of("decode"))  # the plain decoder drains and leaves
        wait_for(lambda: len(instances(cluster, "decode")) == 1, what="one decode instance")
        yield cluster


def test_the_next_turn_continues_on_the_decoder_that_holds_the_history(continuing_decoder, hf_tiny):
    cluster = continuing_decoder
    client = client_for(cluster)
    (decoder,) = instances(cluster, "decode")
    (prefill,) = instances(cluster, "prefill")
    assert decoder["prefills_up_to"] == 256

    first = chat("Where does the fox sleep?")
    one = client.chat.completions.create(
        model="tiny-llava", messages=first, max_tokens=MAX_TOKENS, temperature=0
    )
    answer = one.choices[0].message.content
    assert answer == hf_answer(hf_tiny, first)
    # The decoder announces the turn's blocks (its prompt, imported, and its answer's).
    wait_for(
        lambda: (
            metric(cluster.url, "trident_gateway_prefix_index_keys")
            >= 2 * (one.usage.prompt_tokens // 16 - 1)
        ),
        what="the gateway indexing the first turn at both instances",
    )
    second = chat("Where does the fox sleep?", answer or "ok", "And where does the dog sleep?")
    two = client.chat.completions.create(
        model="tiny-llava", messages=second, max_tokens=MAX_TOKENS, temperature=0
    )
    assert two.choices[0].message.content == hf_answer(hf_tiny, second)
    assert prefix_routes(cluster, "decoder") == 1
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens - 16
    # The decoder ran the second turn's prefill; the prefill instance ran only the first turn's.
    assert metric(decoder["http_address"], "trident_prefills_total") == 1
    assert metric(prefill["http_address"], "trident_prefills_total") == 1
    assert metric(decoder["http_address"], "trident_mailbox_tasks_total") == 1


def test_the_cluster_view_says_which_decoders_continue_turns(continuing_decoder):
    found = continuing_decoder.instances()
    assert [i.get("prefills_up_to") for i in found if "decode" in i["roles"]] == [256]
