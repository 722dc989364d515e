"""Kernel tests run the Triton kernels natively on a CUDA machine and under the Triton
interpreter on a CPU. The interpreter must be chosen before the first kernel is compiled, which
happens lazily on first launch (nanoserve.kernels never imports Triton at import time)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
