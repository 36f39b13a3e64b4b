"""The core board: a worker's step takes every core the other workers on the host leave idle, its
share when they step too or stepped a moment ago, and a worker that died counts as idle."""

from __future__ import annotations

import subprocess
import sys
import time

from common.threads import RECENT
from services.worker.cores import CoreBoard

BUSY_CHILD = """
import sys, time
from services.worker.cores import CoreBoard
board = CoreBoard(sys.argv[1], 2)
board.begin_step()
print("busy", flush=True)
sys.stdin.readline()  # until told
if sys.argv[2] == "end":
    board.end_step()
    print("idle", flush=True)
    sys.stdin.readline()
"""


def other_worker(path, then: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY_CHILD, str(path), then],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "busy\n"
    return proc


def test_a_step_takes_the_cores_the_others_leave(tmp_path):
    board = CoreBoard(tmp_path / "cores", cores=2)
    assert board.begin_step() == 2  # alone on the host: every core
    board.end_step()
    other = other_worker(tmp_path / "cores", "end")
    try:
        assert board.busy_others() == 1
        assert board.begin_step() == 1  # the other steps too: half each
        board.end_step()
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline() == "idle\n"
        # Between its steps a worker still counts as busy; only a while after its last one ends
        # are its cores free.
        assert board.begin_step() == 1
        board.end_step()
        time.sleep(RECENT)
        assert board.begin_step() == 2
        board.end_step()
    finally:
        other.kill()
        other.wait()


def test_a_dead_workers_slot_is_idle_and_taken_over(tmp_path):
    other = other_worker(tmp_path / "cores", "die")
    board = CoreBoard(tmp_path / "cores", cores=4)
    assert board.busy_others() == 1
    other.kill()  # dies mid-step, its mark still set
    other.wait()
    deadline = time.monotonic() + 5
    while board.busy_others() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert board.begin_step() == 4
    newcomer = CoreBoard(tmp_path / "cores", cores=4)
    assert newcomer.slot != board.slot  # the dead worker's slot, not the live one's
    assert newcomer.busy_others() == 1  # this one is stepping
    board.close()
    newcomer.close()


def test_a_worker_that_is_not_greedy_marks_its_steps_but_keeps_its_threads(tmp_path):
    import torch

    decoder = CoreBoard(tmp_path / "cores", cores=2, greedy=False)
    prefill = CoreBoard(tmp_path / "cores", cores=2)
    assert decoder.begin_step() is None  # alone, still its own threads
    assert decoder.step_threads() == torch.get_num_threads()
    assert prefill.busy_others() == 1  # but the others see it stepping
    decoder.end_step()
    decoder.close()
    prefill.close()


def test_a_greedy_step_gives_cores_back_at_the_next_layer(tmp_path):
    """A step that began with every core (the decoder idle) drops to its share at the first layer
    after the decoder starts stepping, not at its own next step: with the threads fixed for the
    step, three threads ran on two cores for the whole of it."""
    import torch

    board = CoreBoard(tmp_path / "cores", cores=2)
    decoder = CoreBoard(tmp_path / "cores", cores=2, greedy=False)
    seen = []

    class Layer(torch.nn.Module):
        def forward(self, x):
            seen.append(torch.get_num_threads())
            if len(seen) == 1:
                decoder.begin_step()  # the decoder starts while this step runs
            return x

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Layer(), Layer(), Layer()])
    board.follow_by_layer(model)
    before = torch.get_num_threads()
    try:
        assert board.begin_step() == 2
        torch.set_num_threads(2)
        x = torch.zeros(1)
        for layer in model.layers:
            x = layer(x)
        assert seen == [2, 1, 1]
        # What the step log records: the step's threads over its layers (the planner fits how
        # steps speed up with threads from them).
        assert board.step_threads() == 4 / 3
        board.end_step()
        decoder.end_step()
        hooks = len(model.layers[0]._forward_pre_hooks)
        decoder.follow_by_layer(model)
        assert len(model.layers[0]._forward_pre_hooks) == hooks  # a decoder keeps its threads
    finally:
        torch.set_num_threads(before)
        board.close()
        decoder.close()
