"""Every environment variable nanoserve reads, named and documented in one place (as vLLM's
``envs.py``): ``ENVIRONMENT_VARIABLES`` holds each one with its meaning, and one accessor per
variable reads it. No other module of the package touches ``os.environ``
(tests/test_envs.py checks).

Caching policy, one for all: nothing here caches. Every accessor reads the environment when it is
called, and a variable set but empty counts as unset. A decision that must stay fixed for the
life of a process is kept by the one module that makes it, not here: the kernel choice
(kernels/choice.py, NANOSERVE_KERNELS), the CPU kernels' instruction-set level (kernels/cpu/ops.py,
NANOSERVE_CPU_ISA, applied when the library loads) and the allocator settings (kernels/cpu/malloc.py).

Writes: nanoserve sets a variable only to hand a setting to a library that reads it when it
loads (libgomp, Triton), before that library loads, through the ``set_*_default`` helpers at the
end; the entry points call them (``nanoserve.cli.main``, the first use of ``nanoserve.LLM``), never
an import. A value the user already set always wins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class EnvironmentVariable:
    name: str
    default: str | None  # as the environment would spell it; None: unset
    doc: str


ENVIRONMENT_VARIABLES: dict[str, EnvironmentVariable] = {}


def _declare(name: str, default: str | None, doc: str) -> str:
    ENVIRONMENT_VARIABLES[name] = EnvironmentVariable(name, default, " ".join(doc.split()))
    return name


_declare(
    "NANOSERVE_HOME",
    None,
    """Where nanoserve keeps what it builds or imports once per machine:
    the default model (models/) and the compiled CPU kernels (cpu-kernels/). Default
    ~/.cache/nanoserve.""",
)
_declare(
    "NANOSERVE_DEBUG",
    None,
    """1: the CLI raises with a full traceback instead of printing a
    one-line error.""",
)
_declare(
    "NANOSERVE_API_KEY",
    None,
    """Require `Authorization: Bearer KEY` on every route but
    /health, /ping, /version and the chat page (--api-key wins over it).""",
)
_declare("VLLM_API_KEY", None, "vLLM's name for NANOSERVE_API_KEY, read when that is unset.")
_declare(
    "NANOSERVE_ALLOW_RUNTIME_LORA_UPDATING",
    None,
    """1: with --enable-lora the server serves POST
    /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters added and removed while it runs).""",
)
_declare(
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    None,
    "vLLM's name for NANOSERVE_ALLOW_RUNTIME_LORA_UPDATING, read when that is unset.",
)
_declare(
    "NANOSERVE_SERVER_DEV_MODE",
    None,
    """1: the server also serves the routes for development
    that change its state (POST /reset_prefix_cache); behind the API key like every route.""",
)
_declare(
    "VLLM_SERVER_DEV_MODE",
    None,
    "vLLM's name for NANOSERVE_SERVER_DEV_MODE, read when that is unset.",
)
_declare(
    "MASTER_ADDR",
    None,
    """Default of --master-addr: rank 0's host for the torch.distributed
    rendezvous.""",
)
_declare(
    "MASTER_PORT",
    None,
    """Default of --master-port: the rendezvous port on rank 0's
    host.""",
)
_declare(
    "GLOO_SOCKET_IFNAME",
    None,
    """gloo's own: the network interface its sockets use. Unless set,
    a single host's ranks (no --master-addr / --master-port) get the loopback interface.""",
)
_declare(
    "NCCL_SOCKET_IFNAME",
    None,
    """NCCL's own: the network interface its bootstrap sockets use.
    Unless set, a single host's ranks (no --master-addr / --master-port) get the loopback
    interface.""",
)
_declare(
    "NANOSERVE_PP_LAYER_PARTITION",
    None,
    """Decoder layers per pipeline stage, comma-separated
    (e.g. '10,14'); overrides EngineConfig.pp_layer_partition and the even split.""",
)
_declare(
    "VLLM_PP_LAYER_PARTITION",
    None,
    """vLLM's name for NANOSERVE_PP_LAYER_PARTITION, read when
    that is unset.""",
)
_declare(
    "VLLM_LOG_STATS_INTERVAL",
    "10",
    """Seconds between the engine's stats log lines; not a
    positive number: the default.""",
)
_declare(
    "NANOSERVE_IMAGE_FETCH_TIMEOUT",
    None,
    """Seconds the http(s) image URLs of one request may take to
    fetch, all of them together (a positive number, default 5; VLLM_IMAGE_FETCH_TIMEOUT also
    works).""",
)
_declare("VLLM_IMAGE_FETCH_TIMEOUT", None, "vLLM's name for NANOSERVE_IMAGE_FETCH_TIMEOUT.")
_declare(
    "NANOSERVE_MEDIA_URL_ALLOW_REDIRECTS",
    None,
    """0: an image URL that redirects is refused; 1 (the default): its redirects
    are followed (at most 5, each checked as the URL is; VLLM_MEDIA_URL_ALLOW_REDIRECTS also
    works).""",
)
_declare(
    "VLLM_MEDIA_URL_ALLOW_REDIRECTS", None, "vLLM's name for NANOSERVE_MEDIA_URL_ALLOW_REDIRECTS."
)
_declare(
    "NANOSERVE_MEDIA_CA_BUNDLE",
    None,
    """A PEM file of CA certificates that https image URLs are
    also verified against, beside the system's (an internal image host's private CA).""",
)
_declare(
    "NANOSERVE_KERNELS",
    "auto",
    """auto (Triton on CUDA, the C++ kernels on a CPU), triton
    (Triton everywhere; TRITON_INTERPRET=1 on a CPU) or reference (the torch references: to rule
    out a kernel bug). Decided at the first dispatch.""",
)
_declare(
    "TRITON_INTERPRET",
    None,
    """Triton's own: 1 runs Triton kernels on a CPU through its
    interpreter (tests, NANOSERVE_KERNELS=triton on a CPU).""",
)
_declare("CXX", None, "The C++ compiler that builds the CPU kernels (default: g++, else c++).")
_declare(
    "NANOSERVE_CPU_ISA",
    None,
    """amx, avx512bf16, avx2 or portable: run the CPU kernels at this
    level (one the CPU runs) instead of the best one it runs.""",
)
_declare(
    "NANOSERVE_CPU_GEMM",
    "nanoserve",
    """nanoserve (our GEMM where it takes the shape) or
    onednn (oneDNN for every linear layer: A/B measurements).""",
)
_declare(
    "NANOSERVE_CPU_PREPACK",
    "1",
    """0: do not prepack weights in oneDNN's layout at load
    (where oneDNN runs the linear layers).""",
)
_declare(
    "NANOSERVE_KEEP_CPU_MEMORY",
    "1",
    """0: leave glibc's malloc as it is instead of keeping
    freed activation memory in the process (so are any MALLOC_*_ settings of glibc's own).""",
)
_declare(
    "GOMP_SPINCOUNT",
    None,
    """libgomp's own: how long idle OpenMP threads spin before they
    sleep. Unless it or OMP_WAIT_POLICY is set, nanoserve's entry points set 10000.""",
)
_declare(
    "OMP_WAIT_POLICY",
    None,
    """OpenMP's own; when set, nanoserve leaves GOMP_SPINCOUNT
    alone.""",
)
_declare(
    "OUT",
    None,
    """nanoserve.bench.kernels: the folder its JSON report goes to (default
    benchmarks/gpu).""",
)


def read(name: str) -> str | None:
    """The raw value of a declared variable (its default when unset or empty). An undeclared
    name is a KeyError: every variable is declared above."""
    declared = ENVIRONMENT_VARIABLES[name]
    return os.environ.get(name) or declared.default


def _flag(name: str) -> bool:
    """On unless the variable says 0 (or off/false/no); an unset one takes its default."""
    value = read(name)
    return value is not None and value.strip().lower() not in ("0", "off", "false", "no")


def _one_of(name: str, choices: tuple[str, ...]) -> str:
    value = (read(name) or "").strip().lower()
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {read(name)!r}")
    return value


def nanoserve_home() -> Path:
    """NANOSERVE_HOME."""
    value = read("NANOSERVE_HOME")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "nanoserve"


def debug() -> bool:
    """NANOSERVE_DEBUG."""
    return _flag("NANOSERVE_DEBUG")


def api_key() -> str | None:
    """NANOSERVE_API_KEY, else VLLM_API_KEY."""
    return read("NANOSERVE_API_KEY") or read("VLLM_API_KEY")


def allow_runtime_lora_updating() -> bool:
    """NANOSERVE_ALLOW_RUNTIME_LORA_UPDATING, else VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    name = "NANOSERVE_ALLOW_RUNTIME_LORA_UPDATING"
    return _flag(name if read(name) is not None else "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def server_dev_mode() -> bool:
    """NANOSERVE_SERVER_DEV_MODE, else VLLM_SERVER_DEV_MODE."""
    name = "NANOSERVE_SERVER_DEV_MODE"
    return _flag(name if read(name) is not None else "VLLM_SERVER_DEV_MODE")


def flag_default(name: str) -> str | None:
    """A config field's `env` default (MASTER_ADDR, MASTER_PORT), raw: the CLI parses it."""
    return read(name)


def pp_layer_partition() -> str | None:
    """NANOSERVE_PP_LAYER_PARTITION, else VLLM_PP_LAYER_PARTITION (unparsed: layer_partition
    checks it against the model)."""
    return read("NANOSERVE_PP_LAYER_PARTITION") or read("VLLM_PP_LAYER_PARTITION")


def log_stats_interval() -> float:
    """VLLM_LOG_STATS_INTERVAL: a positive number of seconds, else the default."""
    default = float(ENVIRONMENT_VARIABLES["VLLM_LOG_STATS_INTERVAL"].default)
    try:
        value = float(read("VLLM_LOG_STATS_INTERVAL"))
    except ValueError:
        return default
    return value if value > 0 else default


def image_fetch_timeout() -> float:
    """NANOSERVE_IMAGE_FETCH_TIMEOUT, else VLLM_IMAGE_FETCH_TIMEOUT: a positive number of
    seconds, else the default."""
    default = 5.0  # vLLM's
    value = read("NANOSERVE_IMAGE_FETCH_TIMEOUT") or read("VLLM_IMAGE_FETCH_TIMEOUT")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return default
    return seconds if seconds > 0 else default


def media_ca_bundle() -> str | None:
    """NANOSERVE_MEDIA_CA_BUNDLE: the path of a PEM file of extra CA certificates, or None."""
    return read("NANOSERVE_MEDIA_CA_BUNDLE")


def media_url_allow_redirects() -> bool:
    """NANOSERVE_MEDIA_URL_ALLOW_REDIRECTS, else VLLM_MEDIA_URL_ALLOW_REDIRECTS (on when
    unset)."""
    name = "NANOSERVE_MEDIA_URL_ALLOW_REDIRECTS"
    if read(name) is None:
        name = "VLLM_MEDIA_URL_ALLOW_REDIRECTS"
    return read(name) is None or _flag(name)


KERNEL_CHOICES = ("auto", "triton", "reference")


def kernels() -> str:
    """NANOSERVE_KERNELS, checked."""
    return _one_of("NANOSERVE_KERNELS", KERNEL_CHOICES)


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1."""
    return read("TRITON_INTERPRET") == "1"


def cxx() -> str | None:
    """CXX."""
    return read("CXX")


def cpu_isa() -> str | None:
    """NANOSERVE_CPU_ISA, lower-cased; None when unset (kernels/cpu/ops.py checks the name)."""
    value = (read("NANOSERVE_CPU_ISA") or "").strip().lower()
    return value or None


def cpu_gemm() -> str:
    """NANOSERVE_CPU_GEMM, checked."""
    return _one_of("NANOSERVE_CPU_GEMM", ("nanoserve", "onednn"))


def cpu_prepack() -> bool:
    """NANOSERVE_CPU_PREPACK."""
    return _flag("NANOSERVE_CPU_PREPACK")


def keep_cpu_memory() -> bool:
    """NANOSERVE_KEEP_CPU_MEMORY, and no MALLOC_*_ variable (glibc's tunables: the user tunes
    malloc, so nanoserve leaves it alone)."""
    tuned = any(name.startswith("MALLOC_") and name.endswith("_") for name in os.environ)
    return _flag("NANOSERVE_KEEP_CPU_MEMORY") and not tuned


def bench_out_dir() -> str | None:
    """OUT."""
    return read("OUT")


# OpenMP threads that finish a parallel region spin before they sleep (libgomp: 300,000 spins by
# default). Alone on its CPUs that wins a few percent; sharing them, it turns three servers on two
# cores into 20x slower each instead of ~4x (measured: a 200-token request, 6.7 s alone, 136-142 s
# three at once with the default, 27 s with 10,000 spins, 7.1 s alone). libgomp reads the variable
# once, when it loads (with torch), so this must run before torch is imported.
OPENMP_SPIN_COUNT = "10000"


def set_openmp_spin_default() -> bool:
    """Set GOMP_SPINCOUNT for this process and the ranks it spawns unless the user chose it (or
    OMP_WAIT_POLICY). Returns whether it takes effect here: False once torch has loaded libgomp
    (children started later still get it)."""
    import sys

    if read("GOMP_SPINCOUNT") is None and read("OMP_WAIT_POLICY") is None:
        os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT
    return "torch" not in sys.modules


def set_triton_interpret_default() -> None:
    """TRITON_INTERPRET=1 unless set: Triton kernels on a CPU (before the first triton.jit)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")


def set_loopback_sockets_default(interface: str) -> None:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, each unless set: a single host's ranks (this
    process's and those it spawns after this) connect over `interface` only, so their sockets
    listen on no address another host can reach. gloo and NCCL read them when a group is made."""
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if read(name) is None:
            os.environ[name] = interface
