"""Shared pytest fixtures; the fast tier's guard. What a run records of itself (deployments started,
durations, the machine's speed beside the run's time) is the plugin tests/run_record.py; the lanes'
scheduler is tests/lanes.py."""

import atexit
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from common import checkpoints  # not `from ... import write_checkpoint`: that loads transformers
from common.infra import NatsServer, RedisServer
from tests.deploy import WARM
from tests.helpers.deployments import REGISTRY, Deployment, shared
from tests.tiers import START_EVENT, mark_slow_folders, starts_a_deployment

pytest_plugins = ["tests.lanes", "tests.run_record"]
RUNNING: list[pytest.Item] = []  # the test whose setup, call or teardown runs now


def pytest_configure(config: pytest.Config) -> None:
    sys.addaudithook(_refuse_unmarked_deployments)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # A lane of `make test` (tests/lanes.py): two lanes on two cores. Torch's own pool would
        # take both cores in each, and its threads spin while they wait: the lanes then slow each
        # other several-fold (the engine tests ran 4x slower beside the other lane).
        import torch  # here, not above: the lanes' controller imports no torch before starting them

        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_slow_folders(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """A run that starts no deployment (the fast tier) forks only tensor owners and pullers from the
    warm forkserver (tests/substrate): it imports what they need, not the services (~4 s a lane)."""
    if not any(item.get_closest_marker("slow") for item in session.items):
        WARM.preload(("torch", "common.transfer.testing", "tests.substrate.helpers"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    RUNNING.append(item)
    try:
        return (yield)
    finally:
        RUNNING.pop()


def _refuse_unmarked_deployments(event: str, args: tuple) -> None:
    """`make test-fast` (`-m "not slow"`) must start no deployment: a test that starts one (a service
    process, `trident up`, Docker Compose) and is not marked slow fails here, at the start, instead
    of silently making the fast tier slow."""
    if (
        event not in ("subprocess.Popen", START_EVENT)
        or not RUNNING
        or RUNNING[-1].get_closest_marker("slow")
    ):
        return
    argv = args[1]
    argv = argv.split() if isinstance(argv, str | bytes) else [str(a) for a in argv]
    if starts_a_deployment(argv):
        raise RuntimeError(
            f"{RUNNING[-1].nodeid} starts a deployment ({' '.join(argv)[:160]}) but is not marked slow: "
            "add `pytestmark = pytest.mark.slow` to its module (see tests/tiers.py)"
        )


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        atexit.register(_exit_once_the_exit_handlers_ran)


def _exit_once_the_exit_handlers_ran() -> None:
    """A lane's interpreter spends ~3 s tearing down what its tests left loaded (models, engines,
    torch), and the run waits for it. Registered last, this runs first: it runs the other exit
    handlers (children reaped, logs flushed, temporary files removed), then ends the process."""
    run_the_rest = getattr(atexit, "_run_exitfuncs", None)  # CPython's; elsewhere, a plain exit
    if run_the_rest is None:
        return
    atexit.unregister(_exit_once_the_exit_handlers_ran)
    run_the_rest()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="session", autouse=True)
def shared_deployments() -> Iterator[None]:
    """Stops the deployments modules share (tests/helpers/deployments.py) that still run at the end."""
    yield
    REGISTRY.close()


# The shared EPD and E+P+D deployments of tiny-llava, for every module that only sends them requests.
epd = shared(Deployment.of(method="epd"))
e_p_d = shared(Deployment.of(method="e+p+d"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-llava checkpoint (seed 0), written once per test session; treat it as read-only."""
    folder = tmp_path_factory.mktemp("checkpoints")
    return checkpoints.write_checkpoint(folder / "tiny-llava", "tiny-llava", seed=0)


@pytest.fixture(scope="session")
def hf_tiny(tiny_model_dir: Path):
    """HF transformers' own model and processor on the tiny checkpoint: the correctness oracle."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_model_dir).eval()
    return model, AutoProcessor.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_generate(hf_tiny):
    """Greedy HF `generate` for one prompt: the generated ids, cut after the first eos. Each answer
    is computed once per session (greedy HF is deterministic): several tests ask the same."""
    import torch

    model, processor = hf_tiny
    answers: dict[tuple, list[int]] = {}

    def run(prompt: str, imgs: list[Image.Image], max_tokens: int) -> list[int]:
        key = (prompt, tuple((img.size, img.mode, img.tobytes()) for img in imgs), max_tokens)
        if key not in answers:
            enc = processor(text=prompt, images=imgs or None, return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
            ids = out[0, enc["input_ids"].shape[1] :].tolist()
            eos = model.config.text_config.eos_token_id
            answers[key] = ids[: ids.index(eos) + 1] if eos in ids else ids
        return list(answers[key])

    return run


@pytest.fixture
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A real nats-server of the test's own (~0.1 s to start): a test that restarts or kills it
    cannot disturb another."""
    with NatsServer(workdir=tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server of the test's own."""
    with RedisServer(workdir=tmp_path_factory.mktemp("redis")) as server:
        yield server
