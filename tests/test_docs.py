"""The docs point at real code: every module, file, test and link that a docstring, a
comment, ``README.md``, ``benchmarks/README.md`` or ``docs/*.md`` names exists in the tree.

What counts as a reference (anything else is prose and left alone):

* a path under one of the tree's folders: ``loading/_read.py``, ``tests/loading/test_read.py``
  (with ``::test_name``: that test is defined there; a bare ``::test_name`` refers to the
  last file so named before it), ``benchmarks/vllm_bench.py``, ``docs/vllm.md``;
* a private module file, ``_read.py``;
* a dotted path through the package or the tree: ``asyncslab.loading._read.ReadFeed``,
  ``loading._strategy_mapped``, ``_read._preadv_raw``, Sphinx's ``~._slabs.SlabSet``,
  ``tests.helpers.until``: each module on the way exists, and the first name past the modules
  is defined in the last one;
* a Sphinx role's target, ``:func:`plan```, ``:meth:`Load.run```: a name the package defines
  (for ``:attr:``, any name of its code);
* a private name alone in backticks, ``_vocabulary``: a module of the package, or a name the
  package defines (a function, a class, a name assigned in a module or class body);
* in a comment, a private name alone (``# see _slabs``): a module, or any name of the code;
* a relative link in Markdown, ``[x](docs/y.md#anchor)``: the file exists, and the anchor is
  one of its headings; in ``benchmarks/runs/``, whose prose names the code of its day, only
  the links are checked.

Beside the scan: the indexes stay indexes (under a size; every run file in the benchmarks'
index), the README keeps its two set-up commands, the test one being what ``.ci/run`` runs,
and no docstring numbers the stages (docs/architecture.md orders them).
"""

from __future__ import annotations

import ast
import functools
import io
import re
import shutil
import subprocess
import tokenize
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "asyncslab"
#: Folders a path in the docs may start from: the tree's, and the package's stages (a path
#: such as ``loading/_read.py`` is read from the package).
TOP = ("asyncslab", "benchmarks", "docs", "examples", "support", "tests", ".ci")
STAGES = ("checkpoint", "planning", "loading", "engines", "distributed", "testing", "cli")
#: The Markdown files scanned besides ``docs/*.md``.
MARKDOWN = ("README.md", "CONTRIBUTING.md", "benchmarks/README.md")
#: The runs' records: only their links are checked (they name the code of their day).
RUNS = "benchmarks/runs/*.md"

_FOLDERS = "|".join(re.escape(f) for f in (*TOP, *STAGES))
_PATH = re.compile(rf"(?<![\w./-])((?:\.\./)*(?:{_FOLDERS})/[\w./-]*[\w/])(?:::(\w+))?")
_MODULE_FILE = re.compile(r"(?<![\w./-])(_[a-z]\w*)\.py\b")
_DOTTED = re.compile(r"(?<![\w.])(~?\.*(?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*)")
_BACKTICKED = re.compile(r"(?<!`)``?(_[a-z][a-z0-9_]*)``?(?!`)")
_BARE = re.compile(r"(?<![\w.`'\"])(_[a-z][a-z0-9_]*)(?![\w(`'\"])")
_PATH_OR_TEST = re.compile(rf"{_PATH.pattern}|(?<![\w/.])::(\w+)")
_ROLE = re.compile(r":(func|class|meth|attr|mod|data|exc|obj):`~?\.?([\w.]+)`")
_EXTENSIONS = frozenset({"py", "md", "json", "sh", "txt", "toml", "png", "safetensors", "so"})
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


@dataclass
class Tree:
    """What the references are checked against, read from a tree's files."""

    root: Path
    #: Module names (file stems and package folders) anywhere in the package.
    modules: set[str] = field(default_factory=set)
    #: Dotted module paths, ``asyncslab.loading._read``, to the names each defines.
    defines: dict[str, set[str]] = field(default_factory=dict)
    #: Names the package defines: functions, classes, names bound in a module or class body.
    definitions: set[str] = field(default_factory=set)
    #: Every identifier of the package's code (attributes, arguments and locals too).
    identifiers: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, root: Path) -> Tree:
        tree = cls(root)
        package = root / PACKAGE
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            tree.modules.update(p for p in parts)
            module = ast.parse(path.read_text(), filename=str(path))
            names = _top_level_names(module)
            tree.defines[".".join(parts)] = names
            tree.definitions |= names
            for node in ast.walk(module):
                if isinstance(node, ast.ClassDef):
                    tree.definitions |= _top_level_names(node)
                    tree.identifiers.add(node.name)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    tree.definitions.add(node.name)
                    tree.identifiers.add(node.name)
                elif isinstance(node, ast.Name):
                    tree.identifiers.add(node.id)
                elif isinstance(node, ast.Attribute):
                    tree.identifiers.add(node.attr)
                elif isinstance(node, ast.arg):
                    tree.identifiers.add(node.arg)
                elif isinstance(node, ast.keyword) and node.arg:
                    tree.identifiers.add(node.arg)
        for sub in tree.defines:  # a package's submodules are its names too
            parent, _, last = sub.rpartition(".")
            if parent in tree.defines:
                tree.defines[parent].add(last)
        tree.identifiers |= tree.definitions
        return tree

    def module_of(self, dotted: list[str]) -> tuple[str, list[str]] | None:
        """The longest module path ``dotted`` starts with, and the rest; None if none."""
        for cut in range(len(dotted), 0, -1):
            name = ".".join(dotted[:cut])
            if name in self.defines:
                return name, dotted[cut:]
        return None


def _top_level_names(node: ast.Module | ast.ClassDef) -> set[str]:
    """The names a module or class body binds (not those of the functions in it)."""
    names: set[str] = set()
    pending: list[ast.stmt] = list(node.body)
    while pending:
        statement = pending.pop()
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
            continue
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in statement.names)
            continue
        for sub in ast.iter_child_nodes(statement):
            if isinstance(sub, ast.stmt):
                pending.append(sub)
            elif isinstance(sub, ast.ExceptHandler):
                pending.extend(sub.body)
            else:
                names.update(
                    n.id
                    for n in ast.walk(sub)
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                )
    return names


@dataclass(frozen=True)
class Text:
    """A piece of a file that may name code: a docstring, a comment or a Markdown line."""

    path: Path
    line: int
    text: str
    comment: bool = False
    #: Only its links are checked (a run's record, whose prose is history).
    links_only: bool = False


def _python_texts(path: Path) -> Iterator[Text]:
    source = path.read_text()
    for node in ast.walk(ast.parse(source, filename=str(path))):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for statement in body:  # docstrings, and the strings documenting an attribute
            if (
                isinstance(statement, ast.Expr)
                and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)
            ):
                yield Text(path, statement.lineno, statement.value.value)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield Text(path, token.start[0], token.string, comment=True)


def _markdown_texts(path: Path, links_only: bool = False) -> Iterator[Text]:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        yield Text(path, number, line, links_only=links_only)


def texts(root: Path) -> Iterator[Text]:
    for path in sorted((root / PACKAGE).rglob("*.py")):
        yield from _python_texts(path)
    for path in [root / name for name in MARKDOWN] + sorted(root.glob("docs/*.md")):
        if path.exists():
            yield from _markdown_texts(path)
    for path in sorted(root.glob(RUNS)):
        yield from _markdown_texts(path, links_only=True)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            slug = base = _slug(m.group(1))
            n = 0
            while slug in found:
                n += 1
                slug = f"{base}-{n}"
            found.add(slug)
    return found


def _file(tree: Tree, text: Text, target: str) -> Path | None:
    """The file ``target`` names, read from the tree's root, the package or the text's own
    folder, or None where none of them has it."""
    for base in (tree.root, tree.root / PACKAGE, text.path.parent):
        for candidate in (base / target, base / f"{target}.py"):  # ``loading/_read``
            if candidate.exists():
                return candidate
    return None


def _defines(path: Path, name: str) -> bool:
    """Whether the Python file at ``path`` defines ``name`` at its top level."""
    return path.suffix == ".py" and name in _names_of_file(path)


@functools.cache
def _names_of_file(path: Path) -> frozenset[str]:
    return frozenset(_top_level_names(ast.parse(path.read_text(), filename=str(path))))


def _dotted_problem(tree: Tree, text: Text, token: str) -> str | None:
    """Why ``token``, a dotted name, names no module or name of the tree; None if it does,
    or is none of ours."""
    token = token.removeprefix("~")
    if token.rsplit(".", 1)[-1] in _EXTENSIONS:
        return None  # a file name: ``model.safetensors.index.json``
    if token.startswith("."):  # relative to the module the text is in (Sphinx)
        here = text.path.relative_to(tree.root).with_suffix("").parts
        if not token.lstrip(".").startswith("_") or here[0] != PACKAGE:
            return None  # a suffix: ``.mlp.experts``
        dots = len(token) - len(token.lstrip("."))
        package = list(here[:-1])
        dotted = [*package[: len(package) - (dots - 1)], *token.lstrip(".").split(".")]
    else:
        dotted = token.split(".")
        if dotted[0] in STAGES:
            if not dotted[1].startswith("_"):
                return None  # an object's attribute: ``checkpoint.table``
            dotted = [PACKAGE, *dotted]
        elif dotted[0] in TOP and dotted[0] != PACKAGE and len(dotted) > 1:
            return _outside_problem(tree, dotted)
        elif dotted[0] != PACKAGE:
            if not dotted[0].startswith("_") or dotted[0].startswith("__"):
                return None  # not ours: ``torch.cuda``, ``self._x``, ``os.preadv``
            if dotted[0] in tree.modules:  # ``_read._preadv_raw``: a module anywhere
                owners = [m for m in tree.defines if m.rsplit(".", 1)[-1] == dotted[0]]
                if len(dotted) > 1 and not any(dotted[1] in tree.defines[m] for m in owners):
                    return f"no module {dotted[0]} defines {dotted[1]}"
                return None
            if dotted[0] in tree.identifiers:
                return None  # an attribute path: ``_staging.close``
            return f"no module or name {dotted[0]}"
    found = tree.module_of(dotted)
    if found is None:
        return f"no module {'.'.join(dotted)}"
    module, rest = found
    if rest and rest[0] not in tree.defines[module]:
        return f"{module} has no module or name {rest[0]}"
    return None


def _outside_problem(tree: Tree, dotted: list[str]) -> str | None:
    """The same for a module outside the package: ``tests.helpers.until``."""
    for cut in range(len(dotted), 1, -1):
        folder = tree.root.joinpath(*dotted[:cut])
        for path in (folder.with_suffix(".py"), folder / "__init__.py"):
            if path.exists():
                if cut < len(dotted) and not _defines(path, dotted[cut]):
                    return f"{'.'.join(dotted[:cut])} has no name {dotted[cut]}"
                return None
    return f"no module {'.'.join(dotted)}"


def problems(root: Path) -> list[str]:
    """Each reference in the tree at ``root`` to a module, file, test or anchor that is not
    there, as ``file:line: what (problem)``."""
    tree = Tree.read(root)
    found: list[str] = []
    last_file: Path | None = None  # the Python file a bare ``::test_name`` refers to
    reading: Path | None = None
    for text in texts(root):
        if text.path != reading:
            reading, last_file = text.path, None

        def report(m: re.Match[str], what: str, why: str, text: Text = text) -> None:
            line = text.line + m.string.count("\n", 0, m.start())
            found.append(f"{text.path.relative_to(root)}:{line}: {what} ({why})")

        if not text.links_only:
            last_file = _code_problems(tree, text, report, last_file)
        if text.path.suffix == ".md":
            _link_problems(text, report)
    return found


Report = Callable[[re.Match[str], str, str], None]


def _code_problems(tree: Tree, text: Text, report: Report, last_file: Path | None) -> Path | None:
    """Report the modules, files and tests ``text`` names that are not there; return the
    Python file named last, which a bare ``::test_name`` after it refers to."""
    body = _LINK.sub(" ", text.text) if text.path.suffix == ".md" else text.text
    for m in _PATH_OR_TEST.finditer(body):
        target, test, alone = m.group(1), m.group(2), m.group(3)
        if alone is not None:
            if last_file is not None and not _defines(last_file, alone):
                where = last_file.relative_to(tree.root)
                report(m, f"::{alone}", f"no such test in {where}")
            continue
        path = _file(tree, text, target)
        if path is None:
            report(m, target, "no such file")
            continue
        if path.suffix == ".py":
            last_file = path
        if test is not None and not _defines(path, test):
            report(m, f"{target}::{test}", "no such test")
    for m in _MODULE_FILE.finditer(body):
        if m.group(1) not in tree.modules:
            report(m, f"{m.group(1)}.py", "no such module")
    without_paths = _PATH.sub(" ", body)
    for m in _DOTTED.finditer(without_paths):
        token = m.group(1).rstrip(".")
        why = _dotted_problem(tree, text, token)
        if why is not None:
            report(m, token, why)
    for m in _ROLE.finditer(body):  # :func:`plan`: a name the package defines
        role, target = m.group(1), m.group(2)
        first, last = target.split(".")[0], target.rsplit(".", 1)[-1]
        if "." in target and first[0].islower() and first not in (PACKAGE, *STAGES):
            continue  # another library's module: :func:`ctypes.get_errno`
        known = tree.identifiers if role in ("attr", "obj") else tree.definitions
        if last not in known and last not in tree.modules:
            report(m, m.group(0), "the package defines no such name")
    for m in _BACKTICKED.finditer(_ROLE.sub(" ", without_paths)):
        if m.group(1) not in tree.modules and m.group(1) not in tree.definitions:
            report(m, m.group(1), "no module or definition of that name")
    if text.comment:
        bare = _BACKTICKED.sub(" ", _DOTTED.sub(" ", without_paths))
        for m in _BARE.finditer(bare):
            if m.group(1) not in tree.modules and m.group(1) not in tree.identifiers:
                report(m, m.group(1), "no module or name")
    return last_file


def _link_problems(text: Text, report: Report) -> None:
    """Report the relative Markdown links of ``text`` to a file or heading not there."""
    for m in _LINK.finditer(text.text):
        link = m.group(1)
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:
        target, _, anchor = link.partition("#")
        path = text.path if not target else (text.path.parent / target)
        if not path.exists():
            report(m, link, "no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            report(m, link, "no such heading")


def test_every_module_file_test_and_link_the_docs_name_exists() -> None:
    found = problems(ROOT)
    assert found == [], "stale references:\n" + "\n".join(found)


def _plant(root: Path) -> None:
    """A small tree with one good and one stale reference of each kind."""
    package = root / PACKAGE / "loading"
    package.mkdir(parents=True)
    (root / PACKAGE / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "_real.py").write_text(
        '"""Reads through ``_real`` and ``_gone``; :class:`~._real.Real` and\n'
        ":class:`~._gone.Real`; see loading/_real.py and loading/_gone.py, ``_helper``\n"
        "and ``_unhelpful``, `loading._real.Real` and `loading._real.Unreal`; :class:`Real`,\n"
        ':func:`gone`, :attr:`_state`, :func:`os.stat`."""\n'
        "\n"
        "\n"
        "class Real:\n"
        "    def __init__(self) -> None:\n"
        "        self._state = 0  # an attribute is no module: see _state, not _gone2\n"
        "\n"
        "\n"
        "def _helper() -> None:\n"
        "    pass\n"
    )
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("def test_here() -> None:\n    pass\n")
    (root / "docs").mkdir()
    (root / "docs" / "here.md").write_text(
        "# A heading\n\nSee [the README](../README.md#set-up) and [nothing](../nowhere.md).\n"
    )
    (root / "README.md").write_text(
        "# Title\n\n## Set up\n\n"
        "[here](docs/here.md#a-heading), [missing](docs/missing.md), "
        "[no anchor](docs/here.md#nowhere), [out](https://example.com/x.md)\n"
        "`tests/test_x.py::test_here`, `::test_gone`; `tests/test_y.py`\n"
        "`asyncslab.loading._real.Real`, `asyncslab.loading._gone`, `_real.py`, `_gone.py`\n"
        "```sh\npython benchmarks/absent.py\n```\n"
    )
    (root / "benchmarks" / "runs").mkdir(parents=True)
    (root / "benchmarks" / "runs" / "run.md").write_text(
        "The code of its day: ``_gone``, loading/_gone.py. [Set up](../../README.md#set-up),\n"
        "[the bench](../README.md#gone).\n"
    )


def test_the_scan_reports_each_stale_reference_and_nothing_else(tmp_path: Path) -> None:
    _plant(tmp_path)
    assert problems(tmp_path) == [
        "asyncslab/loading/_real.py:2: loading/_gone.py (no such file)",
        "asyncslab/loading/_real.py:2: ~._gone.Real"
        " (asyncslab.loading has no module or name _gone)",
        "asyncslab/loading/_real.py:3: loading._real.Unreal"
        " (asyncslab.loading._real has no module or name Unreal)",
        "asyncslab/loading/_real.py:4: :func:`gone` (the package defines no such name)",
        "asyncslab/loading/_real.py:1: _gone (no module or definition of that name)",
        "asyncslab/loading/_real.py:3: _unhelpful (no module or definition of that name)",
        "asyncslab/loading/_real.py:9: _gone2 (no module or name)",
        "README.md:5: docs/missing.md (no such file)",
        "README.md:5: docs/here.md#nowhere (no such heading)",
        "README.md:6: ::test_gone (no such test in tests/test_x.py)",
        "README.md:6: tests/test_y.py (no such file)",
        "README.md:7: _gone.py (no such module)",
        "README.md:7: asyncslab.loading._gone (asyncslab.loading has no module or name _gone)",
        "README.md:9: benchmarks/absent.py (no such file)",
        "docs/here.md:3: ../nowhere.md (no such file)",
        "benchmarks/runs/run.md:2: ../README.md#gone (no such file)",
    ]


#: Files kept as indexes and front pages, not journals: under this many lines (depth goes to
#: docs/, history to benchmarks/runs/).
LIMITS = {"README.md": 151, "benchmarks/README.md": 200, "docs/robustness.md": 300}


@pytest.mark.parametrize(("name", "limit"), LIMITS.items())
def test_an_index_stays_an_index(name: str, limit: int) -> None:
    lines = len((ROOT / name).read_text().splitlines())
    assert lines < limit, f"{name}: {lines} lines (under {limit}); depth to docs/, history to runs/"


def test_every_run_file_is_in_the_benchmarks_index() -> None:
    index = (ROOT / "benchmarks" / "README.md").read_text()
    missing = [
        p.name
        for p in sorted((ROOT / "benchmarks" / "runs").glob("*.md"))
        if f"(runs/{p.name})" not in index
    ]
    assert missing == [], f"benchmarks/README.md's runs table lacks {missing}"


def _setup_commands(readme: str) -> list[str]:
    section = readme.split("\n## Set up", 1)[1].split("\n## ", 1)[0]
    return [block.strip("\n") for block in re.findall(r"```sh\n(.*?)```", section, re.S)]


def test_the_readme_sets_up_in_two_commands_and_ci_runs_the_test_one() -> None:
    demo, tests = _setup_commands((ROOT / "README.md").read_text())  # exactly two
    assert "\n" not in demo, demo
    assert demo.endswith(" && .venv/bin/asyncslab demo"), demo
    assert "\n" not in tests, tests
    assert tests.endswith(" && .venv/bin/python -m pytest"), tests
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_no_docstring_numbers_the_stages() -> None:
    """The stages have one order, docs/architecture.md's; docstrings name a stage
    ("the planning stage", "loading, the tracker") rather than number it."""
    numbered = re.compile(r"\b[Ss]tages? \d")
    paths = [*sorted((ROOT / PACKAGE).rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in paths
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if numbered.search(line)
    ]
    assert found == [], "\n".join(found)


#: The first commit from which every subject fits; the history before it is left as it is.
SUBJECTS_SINCE = "484d338"


def test_commit_subjects_fit_72_columns() -> None:
    """A subject line of at most 72 characters, the details in the body (CONTRIBUTING.md)."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    known = subprocess.run(
        [git, "-C", str(ROOT), "cat-file", "-e", f"{SUBJECTS_SINCE}^{{commit}}"],
        capture_output=True,
    )
    if known.returncode != 0:
        pytest.skip(f"{SUBJECTS_SINCE} is not in this clone's history (a shallow clone)")
    log = subprocess.run(
        [git, "-C", str(ROOT), "log", "--format=%h %s", f"{SUBJECTS_SINCE}^..HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    long = [line for line in log if len(line.split(" ", 1)[1]) > 72]
    assert long == [], "subjects over 72 characters:\n" + "\n".join(long)
