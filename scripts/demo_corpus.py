"""The demo model's code corpus and its held-out split (shared by train_demo_model.py and
eval_demo_model.py, so the evaluation reads exactly the files training never sees).

Sources, both present on every machine that runs freetoken: the running Python's standard
library and its site-packages.  Files are walked in sorted order, filtered (real Python 3 that
`ast` parses, no tests, no generated tables), deduplicated by content, and capped per package.

Held out: whole top-level site-packages packages, chosen by a hash of their name
(sha1(name) % HELDOUT_MOD == 0), plus every file anywhere whose path names one of them (vendored
copies).  The stdlib is never held out: the old demo model trained on all of it, so only
site-packages code is unseen by both the old and the new model.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import sysconfig
from pathlib import Path

HELDOUT_MOD = 16
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "testing", "idle_test",
             "__pycache__", "encodings", "pydoc_data", "_data", "data", "locale", "locales"}
MAX_FILE_BYTES = 200_000
MAX_LINE_CHARS = 400
MAX_PKG_BYTES = 1_500_000   # per top-level package (stdlib counts as one package per top dir)


def _norm(name: str) -> str:
    return name.split(".")[0].lower().lstrip("_")


def is_heldout_name(name: str) -> bool:
    return int(hashlib.sha1(_norm(name).encode()).hexdigest(), 16) % HELDOUT_MOD == 0


_COMMENT_LINE = re.compile(r"^[ \t]*#[^\n]*(\n|$)", re.M)


def drop_comment_lines(text: str) -> str:
    """text without its comment-only lines (a line whose first non-blank character is `#`).
    Such a line never carries syntax, so the result still parses; one inside a string literal
    (a docstring's example) goes too, which only shortens that string.  Inline comments stay."""
    return _COMMENT_LINE.sub("", text)


def _looks_like_code(text: str) -> bool:
    """Real, human-written Python: parses, no minified or table-sized lines."""
    if not text.strip() or len(text.encode()) > MAX_FILE_BYTES:
        return False
    lines = text.splitlines()
    if max(map(len, lines)) > MAX_LINE_CHARS or len(text) / max(1, len(lines)) > 100:
        return False
    try:
        ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return True


def _walk(root: Path):
    """(relative posix path, text) of root's .py files in sorted order, skipped dirs pruned."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith("-info")
                             and not d.startswith("config-"))
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith(("_sysconfigdata", "test_")):
                continue
            path = Path(dirpath) / name
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            yield path.relative_to(root).as_posix(), text


def _package(rel: str) -> str:
    return rel.split("/")[0].removesuffix(".py")


def file_key(rel: str) -> str:
    """The fixed order held-out files are taken in (a hash of the path, no RNG state)."""
    return hashlib.sha1(rel.encode()).hexdigest()


def _digest(text: str) -> str:
    return hashlib.sha1("\n".join(l.rstrip() for l in text.splitlines()).encode()).hexdigest()


def heldout_files(site: Path | None = None) -> list[tuple[str, str]]:
    """("site/<pkg>/...", text) of the held-out packages' code files, deduplicated, sorted."""
    site = site or Path(sysconfig.get_paths()["purelib"])
    seen, out = set(), []
    for entry in sorted(site.iterdir()):
        if not is_heldout_name(entry.name) or entry.name.endswith("-info"):
            continue
        found = _walk(entry) if entry.is_dir() else ([(entry.name, entry.read_text("utf-8"))]
                                                     if entry.suffix == ".py" else [])
        for rel, text in found:
            rel = f"{entry.name}/{rel}" if entry.is_dir() else rel
            if _looks_like_code(text) and _digest(text) not in seen:
                seen.add(_digest(text))
                out.append((f"site/{rel}", text))
    return sorted(out)


def collect(stdlib: Path | None = None, site: Path | None = None
            ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train files, held-out files), each a sorted list of ("stdlib/..." or "site/...", text).
    A training file never equals a held-out one (same text up to trailing whitespace)."""
    stdlib = stdlib or Path(sysconfig.get_paths()["stdlib"])
    site = site or Path(sysconfig.get_paths()["purelib"])
    heldout = heldout_files(site)
    seen = {_digest(t) for _, t in heldout}
    used: dict[str, int] = {}
    train = []
    sources = [("stdlib", p) for p in _walk(stdlib)] + [("site", p) for p in _walk(site)]
    for origin, (rel, text) in sources:
        parts = [_norm(p) for p in rel.split("/")]
        if origin == "site" and any(is_heldout_name(p) for p in parts):
            continue  # a held-out package, or a vendored copy of one
        pkg = f"{origin}:{_package(rel)}"
        if used.get(pkg, 0) >= MAX_PKG_BYTES or not _looks_like_code(text):
            continue
        digest = _digest(text)
        if digest in seen:
            continue
        seen.add(digest)
        used[pkg] = used.get(pkg, 0) + len(text.encode())
        train.append((f"{origin}/{rel}", text))
    return train, heldout


def heldout_prompts(files: list[tuple[str, str]], n: int) -> list[dict]:
    """Up to n prompts: a function signature or class header with its docstring, dedented.
    One per file at most; packages take turns (else the largest one dominates), files within a
    package in a fixed hash order (no RNG state involved)."""
    by_pkg: dict[str, list] = {}
    for rel, text in sorted(files, key=lambda f: file_key(f[0])):
        by_pkg.setdefault(rel.split("/")[1].removesuffix(".py"), []).append((rel, text))
    queues = [iter(by_pkg[k]) for k in sorted(by_pkg)]
    out = []
    while queues and len(out) < n:
        for q in list(queues):
            for rel, text in q:
                prompt = first_documented_def(text)
                if prompt:
                    out.append({"file": rel, "prompt": prompt})
                    break
            else:
                queues.remove(q)
            if len(out) == n:
                break
    return out


def first_documented_def(text: str) -> str | None:
    """Header + docstring of the first def/class (any depth) whose docstring is 1-12 lines."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        body0 = node.body[0] if node.body else None
        if not (isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant)
                and isinstance(body0.value.value, str)) or len(node.body) < 2:
            continue
        if node.decorator_list or not 1 <= body0.end_lineno - body0.lineno + 1 <= 12:
            continue
        chunk = lines[node.lineno - 1:body0.end_lineno]
        indent = len(chunk[0]) - len(chunk[0].lstrip())
        if any(l.strip() and len(l) - len(l.lstrip()) < indent for l in chunk):
            continue
        prompt = "".join(l[indent:] if l.strip() else l.lstrip(" \t") for l in chunk)
        if "\t" not in prompt[:1] and prompt.endswith("\n"):
            try:
                ast.parse(prompt)
            except SyntaxError:
                continue
            return prompt
    return None
