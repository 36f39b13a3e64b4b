"""The docs name only what exists: every repository path, Python module and symbol, setting,
metric and `trident` flag that docs/*.md and README.md give (tests/doc_refs.py says how a name is
recognised), and every link and anchor between them."""

from __future__ import annotations

from functools import cache

import pytest

from services.settings import WorkerSettings
from tests.doc_checks import headings_of, stale_names
from tests.doc_refs import ROOT, Doc, Repo
from trident import settings_doc

DOCS = sorted(["README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])


@cache
def repo() -> Repo:
    return Repo()


def parsed() -> list[Doc]:
    return [Doc(name, (ROOT / name).read_text()) for name in DOCS]


def test_every_name_the_docs_give_exists() -> None:
    docs = parsed()
    headings = {d.path: headings_of(d) for d in docs}
    stale = [str(ref) for doc in docs for ref in stale_names(doc, repo(), headings)]
    assert not stale, f"{len(stale)} names in the docs no longer exist:\n" + "\n".join(stale)


# One of each kind of name, stale, and the same kinds as they exist: the checker must report every
# stale one and none of the others.
PLANTED = """# Planted

Paths: common/engine/no_such.py, `models/no_such.py`, `no_such_module.py`, [gone](gone.md),
[here](#no-such-heading), (engine.md, "No such section").
Names: `common.engine.config.NoSuchConfig`, `Engine.no_such_method`,
`EngineConfig(no_such_field=1)`, `attention.no_such_function`, `models/qwen_vl.no_such_positions`,
`NO_SUCH_CONSTANT`, `TRIDENT_NO_SUCH_SETTING`, `trident_no_such_metric_total`, `--no-such-flag`.

```sh
trident up --no-such-option
python bench/transfer.py --no-such-argument
```

```python
from common.engine import NoSuchName
```
"""
PLANTED_NAMES = [
    "common/engine/no_such.py", "models/no_such.py", "no_such_module.py", "gone.md", "#no-such-heading",
    'engine.md, "No such section"',
    "common.engine.config.NoSuchConfig", "Engine.no_such_method", "EngineConfig.no_such_field",
    "attention.no_such_function", "models/qwen_vl.no_such_positions", "NO_SUCH_CONSTANT",
    "TRIDENT_NO_SUCH_SETTING", "trident_no_such_metric_total", "--no-such-flag",
    "trident up --no-such-option", "bench/transfer.py --no-such-argument", "common.engine.NoSuchName",
]  # fmt: skip
LIVE = """# Live

Paths: common/engine/attention.py, `models/qwen_vl.py`, `free_runs.py`, [engine](engine.md),
[here](#live), (engine.md, "Engine"). Names: `common.engine.config.EngineConfig`, `Handoff.add_prefilled`,
`EngineConfig(prefix_caching=True)`, `attention.varlen_attention_reference`,
`models/qwen_vl.mrope_positions`, `MERGE_FROM_TOKENS`, `TRIDENT_KV_WIRE`, `trident_prefix_hit_tokens_total`,
`trident_encode_queue_seconds`, `--ready-timeout`.

```sh
trident up --ha --method ep+d
python bench/transfer.py --quick
```

```python
from common.engine import Engine, EngineConfig
```
"""


def test_the_checker_reports_each_kind_of_stale_name_and_nothing_live() -> None:
    planted, live = Doc("docs/planted.md", PLANTED), Doc("docs/live.md", LIVE)
    headings = {d.path: headings_of(d) for d in (planted, live, Doc("docs/engine.md", "# Engine"))}
    found = [f"{r.name}" for r in stale_names(planted, repo(), headings)]
    missed = [n for n in PLANTED_NAMES if not any(n in f for f in found)]
    assert not missed, f"not reported: {missed}; reported: {found}"
    assert len(found) == len(PLANTED_NAMES), found
    assert stale_names(live, repo(), headings) == []


def test_the_settings_tables_say_what_the_settings_say() -> None:
    """docs/running.md's configuration tables are what `python -m trident.settings_doc` writes from
    services/settings.py: a setting added, removed, renamed or described anew shows here."""
    text = settings_doc.RUNNING_MD.read_text()
    assert settings_doc.rewrite(text) == text, (
        "run `python -m trident.settings_doc` and commit docs/running.md"
    )


def test_a_setting_without_a_description_stops_the_table() -> None:
    class Undescribed(WorkerSettings):
        no_meaning: int = 3

    table = settings_doc.Table("service", (Undescribed,), "| variable | default | for | meaning |")
    with pytest.raises(ValueError, match="TRIDENT_NO_MEANING has no description"):
        settings_doc.render(table)
