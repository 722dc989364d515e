#!/bin/sh
# nanoserve's install steps, shared by the Dockerfile and tests/test_docker.py: one copy of the
# commands, so that the test runs exactly what an image build runs.
#
#   sh docker/install.sh wheel SRC_DIR OUT_DIR   the wheel of the source tree SRC_DIR (build stage)
#   sh docker/install.sh install WHEEL           WHEEL and its dependencies, into $PYTHON's
#                                                environment (runtime stage; PYTHON defaults to python)
#
# `install` keeps the torch and triton that the environment already has (the PyTorch base image's
# CUDA builds): it pins both to their installed versions in a constraints file, so that pip can
# neither swap torch for a multi-GB build of its own choosing nor pick a triton that does not
# match it, and it fails if either changed all the same. pip's cache follows pip's own settings
# (the Dockerfile sets PIP_NO_CACHE_DIR=1; the test keeps the cache).
set -eu

PYTHON="${PYTHON:-python}"
HERE="$(cd "$(dirname "$0")" && pwd)"

usage() {
    echo "usage: $0 wheel SRC_DIR OUT_DIR | $0 install WHEEL" >&2
    exit 2
}

case "${1:-}" in
    wheel)
        [ "$#" -eq 3 ] || usage
        "$PYTHON" -m pip wheel --no-deps --wheel-dir "$3" "$2"
        ;;
    install)
        [ "$#" -eq 2 ] || usage
        constraints="$(mktemp)"
        trap 'rm -f "$constraints"' EXIT
        "$PYTHON" "$HERE/preinstalled.py" pin torch triton >"$constraints"
        "$PYTHON" -m pip install --constraint "$constraints" "$2"
        "$PYTHON" "$HERE/preinstalled.py" check "$constraints"
        # From / so that `-m` finds the installed package, never a checkout in the working directory.
        (cd / && "$PYTHON" -m nanoserve --help >/dev/null)
        ;;
    *)
        usage
        ;;
esac
