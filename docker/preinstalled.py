"""Pin packages to the versions this Python environment already has, and check they stayed.

    python preinstalled.py pin NAME...      print NAME==VERSION lines (a pip constraints file);
                                            exit 1 if a NAME is not installed
    python preinstalled.py check FILE       exit 1 if an installed version differs from FILE's pin

Used by docker/install.sh so that installing nanoserve keeps the base image's torch and triton.
Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import sys
from importlib import metadata


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pin(names: list[str]) -> int:
    missing = [name for name in names if installed_version(name) is None]
    if missing:
        print(
            f"preinstalled.py: {', '.join(missing)} not installed in {sys.prefix}; the base image "
            "must ship them (nanoserve keeps the base's builds rather than installing its own)",
            file=sys.stderr,
        )
        return 1
    for name in names:
        print(f"{name}=={installed_version(name)}")
    return 0


def check(constraints_path: str) -> int:
    failures = []
    with open(constraints_path, encoding="utf-8") as constraints:
        for line in constraints:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, _, pinned = line.partition("==")
            now = installed_version(name)
            if now != pinned:
                failures.append(f"{name}: {pinned} before the install, {now or 'nothing'} after")
    for failure in failures:
        print(f"preinstalled.py: the install changed {failure}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "pin":
        return pin(argv[1:])
    if len(argv) == 2 and argv[0] == "check":
        return check(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
