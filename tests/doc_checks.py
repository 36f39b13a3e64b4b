"""The checks tests/test_docs.py runs: each takes a parsed doc and the repository and returns the
names the doc gives that no longer exist (tests/doc_refs.py says what counts as a name)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import PurePosixPath

from tests.doc_refs import (
    CONSTANT,
    DOTTED,
    ENV,
    FENCE,
    FLAG,
    KWARG,
    LINK,
    MEMBER,
    METRIC,
    PACKAGES,
    PLACEHOLDER,
    TOP,
    TOP_PATH,
    Doc,
    Ref,
    Repo,
    expand_braces,
    slug,
)

# Words that name an object in an example (`engine.step()`, `store.features`), not a module.
VARIABLES = {
    "engine", "store", "bus", "backend", "pool", "profile", "config", "settings", "runtime", "task",
    "tokenizer",
}  # fmt: skip
# What follows a dot in a file's name, not a module's attribute (`compose.ha.yaml`, `llama.cpp`).
EXTENSIONS = {
    "py", "md", "yaml", "yml", "json", "jsonl", "cpp", "png", "toml", "sh", "txt", "log", "pem", "gguf",
}  # fmt: skip
# Upper-case names of other programs' environments, which our code need not mention.
FOREIGN_CONSTANTS = ("UCX_", "MTMD_", "CKV_", "OMP_", "MKL_", "NCCL_", "HF_", "PYTORCH_", "CUDA_")
# Other programs' flags the docs pass on (docker compose, celery, pytest, pip, the servers).
EXTERNAL_FLAGS = {
    "--build", "--scale", "--profile", "--wait", "--no-recreate", "--app", "--pool", "--concurrency",
    "--save", "--appendonly", "--requirepass", "--port", "--tls-port", "--tls-cert-file", "--tls-key-file",
    "--tls-ca-cert-file", "--tls-auth-clients", "--repl-diskless-load", "--dist", "--mmproj", "--help",
}  # fmt: skip
FILE_SUFFIXES = (".py", ".md")
SECTION_REF = re.compile(r'(\w+\.md), "([^"]+)"')
MODULE_ATTR = re.compile(r"[a-z_]\w*(/\w+)+\.[a-z_]\w*")
# Other projects' files the docs name by themselves (llama.cpp's converter).
FOREIGN_FILES = {"convert_hf_to_gguf.py"}


def stale_paths(doc: Doc, repo: Repo) -> Iterator[Ref]:
    """Paths under a top-level folder anywhere; module-relative paths and file names in code."""
    for number, text in doc.prose + doc.code():
        for match in TOP_PATH.finditer(text):
            token = match.group(1).rstrip(".,;:)")
            before, after = (
                text[max(0, match.start() - 8) : match.start()],
                text[match.end() : match.end() + 1],
            )
            if PLACEHOLDER.search(token + after) or "://" in before:
                continue  # `tests/test_x_<family>.py`, a URL's path: not a literal path
            for path in expand_braces(token):
                if not (repo.exists(path) or _module_attr_exists(path, repo)):
                    yield Ref(doc.path, number, "path", path)
    for number, span in doc.spans:
        for token in span.split():
            token = token.strip("(),;:'\"")
            if PLACEHOLDER.search(token) or "://" in token or not token[:1].isalpha():
                continue
            first = token.split("/")[0]
            if "/" in token and first not in TOP:
                if token.endswith(".py"):
                    if not repo.ends_with(token):
                        yield Ref(doc.path, number, "path", token)
                elif MODULE_ATTR.fullmatch(token) and not _module_attr_exists(token, repo):
                    yield Ref(doc.path, number, "name", token)
            elif "/" not in token and _file_name(token) and not repo.has_file_named(token):
                yield Ref(doc.path, number, "file", token)


def _file_name(token: str) -> bool:
    return (
        token.endswith(FILE_SUFFIXES) and token not in FOREIGN_FILES and bool(re.fullmatch(r"[\w.-]+", token))
    )


def _module_attr_exists(path: str, repo: Repo) -> bool:
    """`trident/bench/oracle.hf_model_inputs`, `models/qwen_vl.mrope_positions`: a module, then a name."""
    head, _, attr = path.rpartition(".")
    if not head or "." in head or not attr.isidentifier():
        return False
    matches = [f for f in repo.files if f == head + ".py" or f.endswith("/" + head + ".py")]
    modules = [".".join(PurePosixPath(f).with_suffix("").parts) for f in matches]
    return any(attr in repo.top_names.get(m, ()) for m in modules)


def stale_links(doc: Doc, repo: Repo, headings: dict[str, set[str]]) -> Iterator[Ref]:
    """Relative links to files that exist, and anchors to headings those files have."""
    for number, line in doc.prose:
        for target in LINK.findall(line):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            name, _, anchor = target.partition("#")
            base = PurePosixPath(doc.path).parent
            path = str(PurePosixPath(*(base / name).parts)) if name else doc.path
            path = _normalise(path)
            if name and not repo.exists(path):
                yield Ref(doc.path, number, "link", target)
            elif anchor and path in headings and anchor not in headings[path]:
                yield Ref(doc.path, number, "anchor", target)


def _normalise(path: str) -> str:
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/".join(parts)


def headings_of(doc: Doc) -> set[str]:
    """The anchors a doc's headings make, and (marked with `§`) the names a reference may quote:
    each heading's text and each bold lead (`**Budgets in service**`)."""
    inside, found = False, set()
    for line in doc.text.splitlines():
        if FENCE.match(line.strip()):
            inside = not inside
        elif not inside and re.match(r"#{1,6} ", line):
            found |= {slug(line.lstrip("#")), "§" + line.lstrip("#").strip().replace("`", "")}
        if not inside:
            found |= {"§" + b.replace("`", "") for b in re.findall(r"\*\*([^*]+)\*\*", line)}
    return found


def stale_sections(doc: Doc, headings: dict[str, set[str]]) -> Iterator[Ref]:
    """`engine.md, "Budgets in service"`: the doc named has a heading or bold lead of that name."""
    for number, line in doc.prose:
        for name, section in SECTION_REF.findall(line):
            target = next((p for p in headings if PurePosixPath(p).name == name), None)
            if target and not any(n.startswith("§" + section) for n in headings[target]):
                yield Ref(doc.path, number, "section", f'{name}, "{section}"')


def stale_python(doc: Doc, repo: Repo) -> Iterator[Ref]:
    """Dotted module paths, imports in examples, `Class.member`, `Class(field=`, constants."""
    for number, text in doc.code():
        for match in DOTTED.finditer(text):
            if not _resolves(match.group(1), repo):
                yield Ref(doc.path, number, "module", match.group(1))
        imported = re.match(r"\s*from ((?:" + "|".join(PACKAGES) + r")[\w.]*) import (.+)", text)
        if imported:
            module, names = imported.groups()
            for name in re.findall(r"\w+", names):
                if module not in repo.modules or name not in repo.top_names[module]:
                    yield Ref(doc.path, number, "import", f"{module}.{name}")
        for cls, member in MEMBER.findall(text) + KWARG.findall(text):
            if repo.has_member(cls, member) is False:
                yield Ref(doc.path, number, "member", f"{cls}.{member}")
    for number, span in doc.spans:
        token = span.strip("()")
        first, _, rest = token.partition(".")
        module = repo.unique_modules.get(first) if first not in VARIABLES else None
        attr = re.match(r"\w+", rest)
        if (
            module
            and attr
            and rest.rsplit(".")[-1] not in EXTENSIONS
            and attr.group() not in repo.top_names[module]
        ):
            yield Ref(doc.path, number, "name", token)
        ours = CONSTANT.match(token) and not token.startswith(("TRIDENT_", *FOREIGN_CONSTANTS))
        if ours and token not in repo.all_constants and token not in repo.source_text:
            yield Ref(doc.path, number, "constant", token)


def _resolves(dotted: str, repo: Repo) -> bool:
    parts = dotted.split(".")
    if parts[0] == "trident" and not any(m.startswith(f"trident.{parts[1]}") for m in repo.modules):
        return True  # a NATS subject or a label under the default namespace (`trident.ctl.cancel`)
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in repo.modules:
            rest = parts[cut:]
            if not rest:
                return True
            if rest[0] not in repo.top_names[module]:
                return False
            return len(rest) == 1 or repo.has_member(rest[0], rest[1]) is not False
    return False


def stale_strings(doc: Doc, repo: Repo) -> Iterator[Ref]:
    """`TRIDENT_*` variables and `trident_*` metrics: the code must still read or expose them."""
    for number, text in doc.prose + doc.code():
        for name in ENV.findall(text):
            # or a name the namespace starts (the task stream: f"{PREFIX}_TASKS")
            quoted_tail = name.removeprefix("TRIDENT") + '"'
            if (
                name not in repo.env_names
                and name not in repo.source_text
                and quoted_tail not in repo.source_text
            ):
                yield Ref(doc.path, number, "variable", name)
    for number, span in doc.spans:
        for name in METRIC.findall(span):
            base = re.sub(r"_(total|bucket|count|sum|info|created)$", "", name)
            if not repo.exposes(base):
                yield Ref(doc.path, number, "metric", name)


def stale_flags(doc: Doc, repo: Repo) -> Iterator[Ref]:
    """Flags after `trident <command>` (its own options), after `python bench/X.py` (the script's)."""
    for number, line in _commands(doc):
        for segment in re.split(r"\||&&|;|#| & ", line):
            words = segment.split()
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]  # `TRIDENT_X=1 trident up`: the environment, then the command
            if words[:1] == ["trident"]:
                path, flags = _trident_command(words[1:], repo)
                known = repo.commands.get(path, set())
                yield from (Ref(doc.path, number, "flag", f"trident {path} {f}") for f in set(flags) - known)
            script = next((w for w in words if re.fullmatch(r"bench/[\w/]+\.py", w)), None)
            if script and (repo.root / script).exists():
                text = (repo.root / script).read_text() + repo.bench_harness_text
                for flag in FLAG.findall(segment):
                    if f'"{flag}"' not in text and flag not in EXTERNAL_FLAGS:
                        yield Ref(doc.path, number, "flag", f"{script} {flag}")
    for number, span in doc.spans:
        if span.startswith("--") and "trident" not in span:
            flag = FLAG.match(span)
            known = set().union(*repo.commands.values()) | EXTERNAL_FLAGS
            if flag and flag.group() not in known and f'"{flag.group()}"' not in repo.source_text:
                yield Ref(doc.path, number, "flag", flag.group())


def _commands(doc: Doc) -> Iterator[tuple[int, str]]:
    """Code lines, a fenced block's continued lines (ending in `\\`) joined into one."""
    yield from doc.spans
    held, start = "", 0
    for number, line in doc.fenced:
        if not held:
            start = number
        held += " " + line.rstrip("\\")
        if not line.rstrip().endswith("\\"):
            yield start, held
            held = ""


def _trident_command(words: list[str], repo: Repo) -> tuple[str, list[str]]:
    path = ""
    for word in words:
        longer = f"{path} {word}".strip()
        if longer not in repo.commands:
            break
        path = longer
    flags = [f for w in words for f in FLAG.findall(w) if w.startswith("--")]
    return path, [f.split("=")[0] for f in flags]


def stale_names(doc: Doc, repo: Repo, headings: dict[str, set[str]]) -> list[Ref]:
    found = [
        *stale_paths(doc, repo), *stale_links(doc, repo, headings), *stale_python(doc, repo),
        *stale_strings(doc, repo), *stale_flags(doc, repo), *stale_sections(doc, headings),
    ]  # fmt: skip
    return sorted(set(found), key=lambda r: (r.doc, r.line, r.kind, r.name))
