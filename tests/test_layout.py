"""The tree shows the request path: no module imports one that imports it back, no service imports
another (shared code lives in common/), and each stage's folder holds its handler. What users drive
(the CLI, the launcher, the benchmark harness: trident/) sits beside the services, which never import it."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("encoder", "prefill", "decode")


def modules() -> dict[str, Path]:
    found = {}
    for package in ("common", "services", "trident"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Project modules `path` imports, type-checking-only imports included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        out |= {n for n in names if n in known}
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) for name, path in known.items()}


def test_no_module_imports_one_that_imports_it_back() -> None:
    edges = graph()
    cycles = []

    def visit(node: str, path: list[str], on_path: set[str], done: set[str]) -> None:
        for nxt in edges.get(node, ()):
            if nxt in on_path:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in done:
                visit(nxt, [*path, nxt], on_path | {nxt}, done)
        done.add(node)

    done: set[str] = set()
    for start in sorted(edges):
        if start not in done:
            visit(start, [start], {start}, done)

    # A package's __init__ re-exporting its own modules is not a cycle between modules.
    def within_a_package(a: str, b: str) -> bool:
        return a.startswith(b + ".") or b.startswith(a + ".")

    real = [c for c in cycles if not any(within_a_package(a, b) for a, b in itertools.pairwise(c))]
    assert not real, "import cycles:\n" + "\n".join(" -> ".join(c) for c in real)


def service_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 2 else None


def test_no_service_imports_another() -> None:
    """Stage handlers build on the worker runtime; any other use of one service by another belongs
    in common/. The worker imports no stage: they are composed outside it (services/stages.py)."""
    allowed = {(stage, "worker") for stage in STAGES}
    crossing = []
    for module, targets in graph().items():
        mine = service_of(module)
        for target in targets:
            theirs = service_of(target)
            if mine and theirs and mine != theirs and (mine, theirs) not in allowed:
                crossing.append(f"{module} -> {target}")
    assert not crossing, "\n".join(crossing)


def test_the_worker_runtime_reaches_no_stage() -> None:
    """Not even through another module: services/worker runs the handlers it is given. Its
    `__main__` alone, the `python -m services.worker` process entry, hands it the composition of
    services/stages.py."""
    edges = graph()

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    leaks = [
        f"{module} -> {target}"
        for module in edges
        if module.startswith("services.worker") and module != "services.worker.__main__"
        for target in reach(module)
        if service_of(target) in STAGES
    ]
    assert not leaks, "\n".join(leaks)


def test_common_imports_no_service() -> None:
    leaks = [
        f"{m} -> {t}"
        for m, ts in graph().items()
        if m.startswith("common")
        for t in ts
        if t.startswith("services")
    ]
    assert not leaks, "\n".join(leaks)


def test_each_stage_folder_holds_its_handler() -> None:
    for stage in STAGES:
        assert (ROOT / "services" / stage / "handler.py").exists(), f"services/{stage}/handler.py"


def test_the_services_and_common_import_nothing_of_the_product_side() -> None:
    """trident/ (CLI, launcher, bench harness) builds on common/ and services/, never the reverse: a
    service image needs none of it."""
    leaks = [
        f"{m} -> {t}"
        for m, ts in graph().items()
        if m.startswith(("common", "services"))
        for t in ts
        if t.startswith("trident")
    ]
    assert not leaks, "\n".join(leaks)


def test_the_bench_harness_imports_nothing_of_the_cli() -> None:
    """The CLI drives the bench harness (trident/bench), and the scripts in bench/ build on it; neither
    reaches back into the CLI (trident/cli): what they share lives in the harness or the launcher."""
    known = modules()
    leaks = [
        f"{m} -> {t}"
        for m, ts in graph().items()
        if m.startswith("trident.bench")
        for t in ts
        if t.startswith("trident.cli")
    ]
    for path in sorted((ROOT / "bench").glob("*.py")):
        leaks += [
            f"{path.relative_to(ROOT)} -> {t}" for t in imports(path, known) if t.startswith("trident.cli")
        ]
    assert not leaks, "\n".join(leaks)


def test_benchmarks_import_no_test_code_and_edit_no_import_path() -> None:
    """The scripts in bench/ run as `python bench/NAME.py` from an installed checkout: what they share
    is in trident/bench/, not in tests/, and none of them puts the repository on sys.path."""
    found = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue  # a peer's build (bench/third_party/.venv-*, .llama.cpp): not ours, not tracked
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tests":
                found.append(f"{path.relative_to(ROOT)} imports {node.module}")
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tests" for a in node.names):
                found.append(f"{path.relative_to(ROOT)} imports tests")
        if "third_party" not in path.parts and "sys.path" in text:
            found.append(f"{path.relative_to(ROOT)} edits sys.path")
    assert not found, "\n".join(found)


def test_no_test_module_imports_another_or_a_conftest() -> None:
    """What tests share lives in helper modules (tests/helpers/, and a folder's own such as
    tests/stages/rig.py), never in a test module or a conftest: a test module can then be moved,
    split or deleted without breaking another, and no test is collected twice by being imported."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module or ''}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                parts = [p for p in name.split(".") if p]
                if any(p.startswith("test_") or p == "conftest" for p in parts):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not found, "\n".join(found)


def body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body, its docstring and signature left out (a CLI command's signature is
    its table of options)."""
    body = function.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return function.end_lineno - body[0].lineno + 1


def test_no_function_body_runs_past_sixty_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({body_lines(node)} lines)"
        for path in [*modules().values(), *sorted((ROOT / "bench").rglob("*.py"))]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and body_lines(node) > 60
    ]
    assert not long, "split these into named parts:\n" + "\n".join(long)
