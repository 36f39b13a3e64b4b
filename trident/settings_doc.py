"""docs/running.md's configuration tables, written from the settings' own descriptions
(services/settings.py), so the reference says what the services read and nothing else.

    python -m trident.settings_doc           # rewrite the tables in docs/running.md
    python -m trident.settings_doc --check   # exit 1, saying so, when they differ from the code

tests/test_docs.py runs the check. A setting without `description=` is an error here: the table
would have a blank where a reader needs the meaning.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from services.settings import GatewaySettings, PlannerSettings, ServiceSettings, WorkerSettings

RUNNING_MD = Path(__file__).resolve().parents[1] / "docs" / "running.md"
# Who reads a setting, by the class that reads it; "all" when every service does.
READERS: tuple[tuple[str, type[BaseSettings]], ...] = (
    ("workers", WorkerSettings),
    ("gateway", GatewaySettings),
    ("planner", PlannerSettings),
)
MIB = 1 << 20
WHO_WRITES = "`python -m trident.settings_doc` writes it from services/settings.py"


@dataclass(frozen=True)
class Table:
    """One generated table: its marker name, the settings classes whose fields it lists."""

    name: str
    classes: tuple[type[BaseSettings], ...]
    header: str


TABLES = (
    Table(
        "service",
        (ServiceSettings, WorkerSettings, GatewaySettings),
        "| variable | default | for | meaning |\n| --- | --- | --- | --- |",
    ),
    Table("planner", (PlannerSettings,), "| variable | default | meaning |\n| --- | --- | --- |"),
)


def begin_marker(name: str) -> str:
    return f"<!-- BEGIN settings table {name}: {WHO_WRITES} -->"


def end_marker(name: str) -> str:
    return f"<!-- END settings table {name} -->"


def show_default(value: object) -> str:
    if value is None:
        return "unset"
    if value == "" and isinstance(value, str):
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and value >= MIB and value % MIB == 0:
        return f"`{value}` ({value // MIB} MiB)"
    return f"`{value}`"


def description(name: str, info: FieldInfo) -> str:
    if not info.description:
        raise ValueError(f"TRIDENT_{name.upper()} has no description= in services/settings.py")
    return info.description.replace("|", "\\|")


def defaults(name: str, readers: list[tuple[str, type[BaseSettings]]]) -> str:
    """One default, or each reader's where they differ (`http_port`: a worker's, the gateway's)."""
    shown = {who: show_default(cls.model_fields[name].default) for who, cls in readers}
    if len(set(shown.values())) == 1:
        return next(iter(shown.values()))
    return ", ".join(f"{who} {value}" for who, value in shown.items())


def own_fields(table: Table) -> list[str]:
    """The table's fields in declaration order, each once; the planner's table lists only its own."""
    names: list[str] = []
    for cls in table.classes:
        inherited = set(ServiceSettings.model_fields) if table.name == "planner" else set()
        names += [n for n in cls.model_fields if n not in names and n not in inherited]
    return names


def render(table: Table) -> str:
    lines = [table.header]
    for name in own_fields(table):
        readers = [(who, cls) for who, cls in READERS if name in cls.model_fields]
        first = next(cls for cls in (ServiceSettings, *table.classes) if name in cls.model_fields)
        meaning = description(name, first.model_fields[name])
        variable = f"`TRIDENT_{name.upper()}`"
        if table.name == "planner":
            lines.append(f"| {variable} | {defaults(name, readers)} | {meaning} |")
            continue
        who = "all" if len(readers) == len(READERS) else ", ".join(w for w, _ in readers)
        lines.append(f"| {variable} | {defaults(name, readers)} | {who} | {meaning} |")
    return "\n".join(lines)


def rewrite(text: str) -> str:
    """`text` with every generated table replaced by what the settings say now."""
    for table in TABLES:
        begin, end = begin_marker(table.name), end_marker(table.name)
        if text.count(begin) != 1 or text.count(end) != 1:
            raise ValueError(f"docs/running.md needs exactly one pair of markers for the {table.name} table")
        head, rest = text.split(begin)
        _, tail = rest.split(end)
        text = f"{head}{begin}\n{render(table)}\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether the tables are current")
    args = parser.parse_args(argv)
    text = RUNNING_MD.read_text()
    fresh = rewrite(text)
    if args.check:
        if fresh != text:
            print("docs/running.md's settings tables differ from services/settings.py:", file=sys.stderr)
            print("run `python -m trident.settings_doc` and commit the result", file=sys.stderr)
            return 1
        return 0
    if fresh != text:
        RUNNING_MD.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
