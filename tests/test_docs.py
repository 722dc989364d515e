"""README.md and the pages under docs/ stay true to the repository.

- README is short (under 250 lines) and links every docs page;
- every relative link and image in README and docs resolves to a file inside the repository, and
  no text points outside it (`../shared/...` is not part of the checkout);
- every path a page names in code (`scripts/...`, `benchmarks/...`, `kernels/cpu/...`) exists;
- every command a page shows in a shell block or an inline code span is checked: `nanoserve ...`
  parses with the real CLI parser (each flag exists, each value has the right type), `make T`
  names a Makefile target (and its `ARGS` parse as flags of what the target runs), `python
  path.py` / `python -m module` name a file or module that exists.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve import cli
from tests.test_docker import shell_commands

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
DOCUMENTS = [README, *PAGES]
MAX_README_LINES = 250

# Top-level folders of the checkout, and the package's own folders that pages name without the
# `nanoserve/` prefix (`kernels/cpu/gemm.cpp`).
REPO_FOLDERS = ("nanoserve", "scripts", "benchmarks", "tests", "docker", "docs")
PACKAGE_FOLDERS = tuple(
    path.name for path in (ROOT / "nanoserve").iterdir() if path.is_dir() and path.name[0] != "_"
)


def relative_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def markdown_links(text: str) -> list[str]:
    """Targets of `[text](target)` and `![alt](target)`, outside code."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return re.findall(r"\]\(([^)\s]+)\)", prose)


def broken_links(document: Path, text: str) -> list[str]:
    """Relative links that name no file or leave the repository."""
    broken = []
    for target in markdown_links(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        resolved = (document.parent / target.split("#", 1)[0]).resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(target)
    return broken


def outside_references(text: str) -> list[str]:
    """`../...` paths that leave the repository, wherever they appear (code, prose, links)."""
    return [
        match
        for match in re.findall(r"(?<![\w./])\.\./[\w./-]*", text)
        if not (DOCS / match).resolve().is_relative_to(ROOT)
        or (DOCS / match).resolve().name == "shared"
        or "/shared/" in match
    ]


def inline_code(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.findall(r"`([^`\n]+)`", prose)


def named_paths(text: str) -> list[str]:
    """Repository paths a page names in inline code: `scripts/x.py`, `benchmarks/lora/`, ..."""
    names = []
    for code in inline_code(text):
        for token in code.split():
            token = token.strip(",;:()")
            head = token.split("/", 1)[0]
            if "/" in token and (head in REPO_FOLDERS or head in PACKAGE_FOLDERS):
                names.append(token)
    return names


def path_exists(name: str) -> bool:
    name = name.rstrip("/")
    return any((base / name).exists() for base in (ROOT, ROOT / "nanoserve"))


def page_commands(text: str) -> list[list[str]]:
    """Commands of the shell blocks, and inline code spans that start with a command we check."""
    commands = shell_commands(text)
    for code in inline_code(text):
        if re.match(r"(nanoserve|make|python) ", code):
            with contextlib.suppress(ValueError):  # prose like `nanoserve ... --help` lists
                commands.extend(shell_commands(f"```bash\n{code}\n```\n"))
    return commands


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", text, re.MULTILINE))


def parse_nanoserve(args: list[str]) -> str | None:
    """None if the real parser takes `nanoserve ARGS`, else its complaint."""
    if not args or (args[0] not in cli.SUBCOMMANDS and args[0] not in ("-h", "--help")):
        args = ["serve", *args]  # as cli.main: `nanoserve --model X` serves
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            cli.build_parser().parse_args(args)
    except SystemExit as exit_:
        if exit_.code:
            return stderr.getvalue().strip().splitlines()[-1]
    return None


@functools.cache
def bench_flags(kind: str) -> frozenset[str]:
    """The flags `nanoserve bench KIND --help` lists (each benchmark parses its own arguments)."""
    result = subprocess.run(
        [sys.executable, "-m", "nanoserve", "bench", kind, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9-]*)", result.stdout))


def bench_problems(args: list[str]) -> list[str]:
    """Flags of `nanoserve bench KIND ARGS` that the benchmark does not take."""
    kind, rest = args[1], args[2:]
    flags = [token.split("=", 1)[0] for token in rest if re.match(r"--?[A-Za-z]", token)]
    return [
        f"`nanoserve bench {kind}` has no flag {flag}"
        for flag in flags
        if flag not in bench_flags(kind)
    ]


def command_problems(argv: list[str]) -> list[str]:
    """What is wrong with one documented command (empty when it is right)."""
    line = shlex.join(argv)
    program, args = argv[0], argv[1:]
    if program == "nanoserve":
        complaint = parse_nanoserve(args)
        if complaint:
            return [f"{line}: {complaint}"]
        if args[:1] == ["bench"]:
            return [f"{line}: {problem}" for problem in bench_problems(args)]
        return []
    if program == "make":
        problems = []
        targets = [arg for arg in args if "=" not in arg and not arg.startswith("-")]
        for target in targets:
            if target not in makefile_targets():
                problems.append(f"{line}: the Makefile has no target {target!r}")
        for arg in args:
            if arg.startswith("ARGS=") and targets[:1] == ["serve"]:
                complaint = parse_nanoserve(["serve", *shlex.split(arg[len("ARGS=") :])])
                if complaint:
                    problems.append(f"{line}: {complaint}")
        return problems
    if re.fullmatch(r"python3?", program) and args:
        if args[0] == "-m" and len(args) > 1:
            if importlib.util.find_spec(args[1]) is None:
                return [f"{line}: no module {args[1]}"]
        elif not args[0].startswith("-") and not (ROOT / args[0]).exists():
            return [f"{line}: no file {args[0]}"]
    if re.match(r"(scripts|benchmarks)/", program) and not (ROOT / program).exists():
        return [f"{line}: no file {program}"]
    return []


def checked_commands() -> list[tuple[str, list[str]]]:
    return [
        (relative_name(document), argv)
        for document in DOCUMENTS
        for argv in page_commands(document.read_text())
        if argv[0] in ("nanoserve", "make", "python", "python3")
        or re.match(r"(scripts|benchmarks)/", argv[0])
    ]


# --------------------------------------------------------------------------------- the tests


def test_readme_is_short_and_links_every_page():
    text = README.read_text()
    assert len(text.splitlines()) < MAX_README_LINES, "README.md: move reference text to docs/"
    assert len(PAGES) >= 12, [page.name for page in PAGES]
    linked = {(ROOT / target.split("#")[0]).resolve() for target in markdown_links(text)}
    unlinked = [page.name for page in PAGES if page.resolve() not in linked]
    assert unlinked == [], f"README.md does not link {unlinked}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=relative_name)
def test_links_resolve_inside_the_repository(document):
    text = document.read_text()
    assert broken_links(document, text) == []
    assert outside_references(text) == []


@pytest.mark.parametrize("document", DOCUMENTS, ids=relative_name)
def test_named_paths_exist(document):
    missing = [name for name in named_paths(document.read_text()) if not path_exists(name)]
    assert missing == [], f"{relative_name(document)} names paths that do not exist"


@pytest.mark.parametrize("document", DOCUMENTS, ids=relative_name)
def test_commands_parse(document):
    problems = [
        problem
        for argv in page_commands(document.read_text())
        for problem in command_problems(argv)
    ]
    assert problems == []


def test_the_pages_show_the_commands_they_describe():
    """The checks above have something to check: the set-up commands and each feature's own."""
    commands = checked_commands()
    shown = {(where, shlex.join(argv[:2])) for where, argv in commands}
    for expected in [
        ("README.md", "make serve"),
        ("README.md", "make test"),
        ("docs/serving.md", "nanoserve serve"),
        ("docs/serving.md", "nanoserve generate"),
        ("docs/quantization.md", "nanoserve serve"),
        ("docs/parallelism.md", "nanoserve serve"),
        ("docs/lora.md", "nanoserve serve"),
        ("docs/tools.md", "nanoserve serve"),
        ("docs/images.md", "nanoserve serve"),
        ("docs/deployment.md", "nanoserve serve"),
        ("docs/benchmarks.md", "make bench"),
        ("docs/benchmarks.md", "nanoserve bench"),
    ]:
        assert expected in shown, f"{expected[0]} shows no `{expected[1]} ...` command"
    assert len(commands) >= 25


# ------------------------------------------------------------- the checks can fail


def test_checks_find_what_is_wrong(tmp_path):
    assert command_problems(["nanoserve", "serve", "--no-such-flag"])
    assert command_problems(["nanoserve", "serve", "--max-num-seqs", "many"])  # not an integer
    assert command_problems(["nanoserve", "--tp"])  # a flag without its value
    assert command_problems(["make", "no-such-target"])
    assert command_problems(["make", "serve", "ARGS=--no-such-flag"])
    assert command_problems(["python", "scripts/no_such_script.py"])
    assert command_problems(["python", "-m", "nanoserve.no_such_module"])
    assert command_problems(["nanoserve", "bench", "throughput", "--no-such-flag", "1"])
    assert not command_problems(["nanoserve", "bench", "throughput", "--num-prompts", "8"])
    assert not command_problems(["nanoserve", "--model", "m", "--tp", "2"])
    assert not command_problems(["make", "test", "ARGS=-x"])

    page = DOCS / "example.md"
    assert broken_links(page, "see [x](no-such-page.md) and ![y](../README.md)") == [
        "no-such-page.md"
    ]
    assert broken_links(page, "[out](../../outside.md)") == ["../../outside.md"]
    assert outside_references("from `../shared/bench/batch1.sh`") == ["../shared/bench/batch1.sh"]
    assert not path_exists("scripts/no_such_script.py")
    assert path_exists("kernels/cpu/") and path_exists("docs/")
    assert named_paths("run `scripts/perplexity.py --x` on `kernels/cpu/gemm.cpp`") == [
        "scripts/perplexity.py",
        "kernels/cpu/gemm.cpp",
    ]
    readme_commands = shell_commands("```bash\nmake serve\nnanoserve --model m  # serves\n```\n")
    assert readme_commands == [["make", "serve"], ["nanoserve", "--model", "m"]]
