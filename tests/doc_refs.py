"""What the docs name, and whether it still exists: repository paths, Python modules and symbols,
environment variables, metrics and `trident` flags (tests/test_docs.py runs it over docs/*.md and
README.md).

Precise over complete: a name is checked only where its form says what it must be (a path under a
top-level folder, `common.x.Y`, `Class.member` of a class this repository defines, `TRIDENT_X`, a
flag after `trident <command>`); anything that could as well be another project's name is left
alone, so a failure is a stale name and not a guess.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "services", "trident")
# The folders a path in the docs may start with (runtime paths like .trident/ or /secrets are not ours).
TOP = ("common", "services", "trident", "tests", "bench", "docs", "deploy", "monitoring", "data")
SKIP_DIRS = {"__pycache__", "node_modules"}
# Where a name ends and a placeholder or a pattern begins: not a literal path to check.
PLACEHOLDER = re.compile(r"[<>*$…]|\.\.\.|\bDIR\b|\bFILE\b")
FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]*)\)")
TOP_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP) + r")/[\w./{},+-]*[\w/}])")
DOTTED = re.compile(r"(?<![\w./-])((?:" + "|".join(PACKAGES) + r")(?:\.\w+)+)")
MEMBER = re.compile(r"(?<![\w.])([A-Z][A-Za-z0-9]+)\.([a-z_][A-Za-z0-9_]*)\b")
KWARG = re.compile(r"(?<![\w.])([A-Z][A-Za-z0-9]+)\(([a-z_]\w*)=")
CONSTANT = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")
ENV = re.compile(r"\bTRIDENT_[A-Z0-9_]*[A-Z0-9]\b")
METRIC = re.compile(r"\btrident_[a-z0-9_]+[a-z0-9]\b")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@dataclass(frozen=True)
class Ref:
    """One name a doc gives, where it gives it."""

    doc: str
    line: int
    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.kind} {self.name}"


@dataclass
class Doc:
    """A markdown file cut into what is prose, inline code, fenced code and links, line by line."""

    path: str
    text: str
    prose: list[tuple[int, str]] = field(default_factory=list)
    spans: list[tuple[int, str]] = field(default_factory=list)
    fenced: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        inside = False
        for number, line in enumerate(self.text.splitlines(), 1):
            if FENCE.match(line.strip()):
                inside = not inside
                continue
            if inside:
                self.fenced.append((number, line))
                continue
            self.spans += [(number, s) for s in CODE_SPAN.findall(line)]
            self.prose.append((number, CODE_SPAN.sub(" ", line)))

    def code(self) -> list[tuple[int, str]]:
        return self.spans + self.fenced


def expand_braces(text: str) -> list[str]:
    """`services/{encoder,prefill}/` -> both paths, as a shell would."""
    match = re.search(r"\{([^{}]*)\}", text)
    if not match:
        return [text]
    head, tail = text[: match.start()], text[match.end() :]
    return [p for alt in match.group(1).split(",") for p in expand_braces(head + alt + tail)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\]\([^)]*\)|\[", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


class Repo:
    """The files, Python definitions, settings and CLI the docs are checked against."""

    def __init__(self, root: Path = ROOT) -> None:
        self.root = root

    @cached_property
    def files(self) -> set[str]:
        found = set()
        for top in TOP:
            for path in (self.root / top).rglob("*"):
                parts = path.relative_to(self.root).parts
                if path.is_file() and not any(p in SKIP_DIRS or p.startswith(".") for p in parts):
                    found.add("/".join(parts))
        return found | {p.name for p in self.root.iterdir() if p.is_file()}

    @cached_property
    def dirs(self) -> set[str]:
        return {str(PurePosixPath(f).parents[i]) for f in self.files for i in range(len(f.split("/")) - 1)}

    def exists(self, path: str) -> bool:
        path = path.rstrip("/")
        return path in self.files or path in self.dirs

    @cached_property
    def file_names(self) -> set[str]:
        return {PurePosixPath(f).name for f in self.files}

    def has_file_named(self, name: str) -> bool:
        return name in self.file_names

    def ends_with(self, tail: str) -> bool:
        return any(f == tail or f.endswith("/" + tail) for f in self.files)

    @cached_property
    def modules(self) -> dict[str, ast.Module]:
        out = {}
        for name in sorted(self.files):
            if name.endswith(".py") and name.split("/")[0] in PACKAGES:
                parts = PurePosixPath(name).with_suffix("").parts
                dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                out[dotted] = ast.parse((self.root / name).read_text())
        return out

    @cached_property
    def top_names(self) -> dict[str, set[str]]:
        """Names a module defines or imports at its top level (what `module.name` can reach)."""
        return {m: _bound_names(tree.body) for m, tree in self.modules.items()}

    @cached_property
    def classes(self) -> dict[str, list[ast.ClassDef]]:
        out: dict[str, list[ast.ClassDef]] = {}
        for module, tree in self.modules.items():
            if module.split(".")[0] in PACKAGES:
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef):
                        out.setdefault(node.name, []).append(node)
        return out

    def members(self, cls: str, seen: frozenset[str] = frozenset()) -> tuple[set[str], bool]:
        """Every attribute a class of ours declares or inherits from ours, and whether some base is
        another project's (whose attributes the class has too, unseen here)."""
        found: set[str] = set()
        open_ = False
        for node in self.classes.get(cls, ()):
            found |= _bound_names(node.body)
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and fn.name == "__init__":
                    found |= {a.arg for a in fn.args.args + fn.args.kwonlyargs}
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if name in self.classes and name not in seen:
                    inherited, inherited_open = self.members(name, seen | {cls})
                    found |= inherited
                    open_ |= inherited_open
                elif name not in CLOSED_BASES:
                    open_ = True
        return found, open_

    def has_member(self, cls: str, member: str) -> bool | None:
        """True, False, or None where it cannot be told (not our class, or a foreign base)."""
        if cls not in self.classes or len(member) < 2 or member.startswith(("model_", "__")):
            return None
        found, open_ = self.members(cls)
        return True if member in found else (None if open_ else False)

    @cached_property
    def all_constants(self) -> set[str]:
        return {n for names in self.top_names.values() for n in names if CONSTANT.match(n)} | {
            n for nodes in self.classes.values() for c in nodes for n in _bound_names(c.body)
        }

    @cached_property
    def source_text(self) -> str:
        """Every source file's text: for names that live in strings (variables, metrics, flags)."""
        wanted = (".py", ".sh", ".yaml", ".yml", ".json", ".toml")
        return "\n".join(
            (self.root / f).read_text(errors="replace")
            for f in sorted(self.files)
            if (f.endswith(wanted) or f.startswith(("Makefile", "Dockerfile")))
            and not f.startswith(("docs/", "tests/data/", "tests/doc_", "tests/test_docs"))
        )

    @cached_property
    def python_text(self) -> str:
        return "\n".join(
            (self.root / f).read_text()
            for f in sorted(self.files)
            if f.endswith(".py") and f.startswith(PACKAGES)
        )

    @cached_property
    def metric_templates(self) -> list[re.Pattern[str]]:
        """Metric names as the code writes them: `f"trident_{name}"` over a table of names, or whole."""
        found = re.findall(r'f"(trident_[^"]*)"', self.python_text)
        found = [t for t in found if len(re.sub(r"\{[^}]*\}", "", t)) > len("trident_")]  # not bare `{name}`
        return [re.compile(re.sub(r"\\\{[^}]*\\\}", r"\\w+", re.escape(t)) + "$") for t in found]

    def exposes(self, metric: str) -> bool:
        own = metric.removeprefix("trident_")
        if metric in self.python_text or f'"{own}"' in self.python_text:
            return True
        return any(t.match(metric) for t in self.metric_templates)

    @cached_property
    def bench_harness_text(self) -> str:
        """What the bench scripts build their options from, besides their own source."""
        return "\n".join(
            (self.root / f).read_text() for f in sorted(self.files) if f.startswith("trident/bench/")
        )

    @cached_property
    def unique_modules(self) -> dict[str, str]:
        """A module's own name -> the module, for names only one module file has and no package does."""
        by_name: dict[str, list[str]] = {}
        for module in self.modules:
            if module.split(".")[0] in PACKAGES:
                by_name.setdefault(module.rsplit(".", 1)[-1], []).append(module)
        packages = {m.rsplit(".", 1)[-1] for m in self.modules if (self.root / m.replace(".", "/")).is_dir()}
        return {n: ms[0] for n, ms in by_name.items() if len(ms) == 1 and n not in packages}

    @cached_property
    def env_names(self) -> set[str]:
        """The variables the services' settings read."""
        from services import settings

        classes = (settings.WorkerSettings, settings.GatewaySettings, settings.PlannerSettings)
        return {f"TRIDENT_{name.upper()}" for cls in classes for name in cls.model_fields}

    @cached_property
    def commands(self) -> dict[str, set[str]]:
        """`trident` command path (e.g. "bench compare") -> its option strings."""
        import click
        import typer

        from trident.cli.app import app

        out: dict[str, set[str]] = {}

        def walk(cmd: click.Command, path: str) -> None:
            out[path] = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
            for name, sub in getattr(cmd, "commands", {}).items():
                walk(sub, f"{path} {name}".strip())

        walk(typer.main.get_command(app), "")
        return out


# Bases that add no attribute a doc would name as the class's own (pydantic's `model_*` aside).
CLOSED_BASES = {
    "object", "Protocol", "Generic", "ABC", "Enum", "StrEnum", "IntEnum", "NamedTuple", "BaseModel",
    "BaseSettings",
}  # fmt: skip


def _bound_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If | ast.Try):
            names |= _bound_names(node.body) | _bound_names(getattr(node, "orelse", []))
            for handler in getattr(node, "handlers", []):
                names |= _bound_names(handler.body)
    return names
