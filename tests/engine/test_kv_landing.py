"""A request's KV written into its reserved blocks from another thread while the decoder steps
others (`Handoff.land`, writes, `commit`; kv_landing.py), as decode's pulls write it: its answer
is HF's, the others' too, and a landing that is dropped, aborted or closed mid-write gives its
blocks back with nothing written after."""

from __future__ import annotations

import threading

import pytest
import torch

from common.engine import AdmissionError
from common.engine.kv_landing import LandingClosed
from common.engine.sampling import SamplingParams
from common.roles import Role
from tests.helpers.engine import QUESTIONS


def _prefilled(make_engine, images, question: int, max_tokens: int):
    """A prefill engine's request, prefilled, and its KV exported in groups of two layers."""
    pre = make_engine(roles=frozenset({Role.ENCODE, Role.PREFILL}))
    prompt = pre.chat_prompt(QUESTIONS[question], 1)
    req = pre.add_request(prompt, images[:1], SamplingParams(max_tokens=max_tokens), request_id="landed")
    while pre.has_unfinished():
        pre.step()
    return prompt, req, pre.handoff.export_kv("landed", group_size=2)


def test_kv_written_on_another_thread_while_the_decoder_steps_gives_hfs_answer(
    make_engine, hf_generate, images
):
    prompt, preq, kv = _prefilled(make_engine, images, 1, 16)
    dec = make_engine()  # every role: the other request is encoded and prefilled here
    other_prompt = dec.chat_prompt(QUESTIONS[2], 1)
    other = dec.add_request(other_prompt, images[1:2], SamplingParams(max_tokens=24))
    dec.step()
    landing = dec.handoff.land("landed", kv[0].shape[2])
    dec.check_integrity()  # its blocks are the landing's, not a request's
    start = [0, kv[0].shape[0]]
    writers = [
        threading.Thread(target=landing.write, args=(s, buf)) for s, buf in zip(start, kv, strict=True)
    ]
    for w in writers:
        w.start()
    while any(w.is_alive() for w in writers):
        dec.step()  # the other request decodes meanwhile
    for w in writers:
        w.join()
    got = dec.handoff.commit("landed", preq.prompt_token_ids, preq.output_token_ids, preq.params)
    with pytest.raises(LandingClosed):
        landing.write(0, kv[0])  # nothing after the commit
    while dec.has_unfinished():
        dec.step()
        dec.check_integrity()
    assert got.output_token_ids == hf_generate(prompt, images[:1], 16)
    assert other.output_token_ids == hf_generate(other_prompt, images[1:2], 24)


def test_a_dropped_or_aborted_landing_gives_its_blocks_back(make_engine, images):
    _, _, kv = _prefilled(make_engine, images, 0, 4)
    dec = make_engine(roles=frozenset({Role.DECODE}))
    free = dec.blocks.num_free
    for end in (dec.handoff.drop, dec.abort):
        landing = dec.handoff.land("landed", kv[0].shape[2])
        assert dec.blocks.num_free == free - kv[0].shape[2]
        landing.write(0, kv[0])
        end("landed")
        assert dec.blocks.num_free == free and not dec.handoff.landings
        with pytest.raises(LandingClosed):
            landing.write(0, kv[0])
        dec.check_integrity()
    assert dec.handoff.drop("landed") is False


def test_a_drop_waits_for_a_write_under_way(make_engine, images, monkeypatch):
    _, _, kv = _prefilled(make_engine, images, 0, 4)
    dec = make_engine(roles=frozenset({Role.DECODE}))
    landing = dec.handoff.land("landed", kv[0].shape[2])
    writing, go, dropped = threading.Event(), threading.Event(), threading.Event()
    real = dec.cache.import_blocks

    def slow_import(*args):
        writing.set()
        assert go.wait(10)
        real(*args)

    monkeypatch.setattr(dec.cache, "import_blocks", slow_import)
    writer = threading.Thread(target=landing.write, args=(0, kv[0]))
    writer.start()
    assert writing.wait(10)
    dropper = threading.Thread(target=lambda: (dec.handoff.drop("landed"), dropped.set()))
    dropper.start()
    assert not dropped.wait(0.2), "the blocks went back while a write was under way"
    go.set()
    assert dropped.wait(10)
    writer.join(10)
    dropper.join(10)
    assert dec.blocks.num_free == dec.blocks.num_blocks


def test_what_cannot_land_is_refused_before_any_block_is_written(make_engine, images):
    _, preq, kv = _prefilled(make_engine, images, 0, 4)
    dec = make_engine(roles=frozenset({Role.DECODE}))
    with pytest.raises(AdmissionError, match="no free KV blocks"):
        dec.handoff.land("huge", dec.blocks.num_blocks + 1)
    landing = dec.handoff.land("landed", kv[0].shape[2])
    with pytest.raises(AdmissionError, match="already in use"):
        dec.handoff.land("landed", 1)
    with pytest.raises(ValueError, match="this model has"):
        landing.write(3, kv[0])  # layers 3-4 of a 4-layer model
    with pytest.raises(ValueError, match="were reserved"):
        landing.write(0, torch.cat([kv[0], kv[0]], dim=2))  # more blocks than reserved
    # A request that cannot run here fails its commit, and its blocks go back.
    with pytest.raises(AdmissionError):
        dec.handoff.commit(
            "landed", preq.prompt_token_ids, preq.output_token_ids, SamplingParams(max_tokens=10**6)
        )
    assert dec.blocks.num_free == dec.blocks.num_blocks and not dec.handoff.landings
    dec.check_integrity()
