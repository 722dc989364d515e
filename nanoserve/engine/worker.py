"""The engine's side of tensor and pipeline parallelism: the plan (which ranks, which layers on
which stage, checked against the model before any rank starts) and the worker entry point that
ranks > 0 run. distributed/launcher.py starts the processes and joins the process group; it is
handed `run_worker` as its target and knows nothing of models or runners (as nano-vllm's
`Process(target=ModelRunner)` and vLLM's executor spawning its worker).

A worker builds the same model on its weight shard, then runs every step that rank 0 broadcasts
until it says stop (ModelRunner.worker_loop; the step's wire format is beside ModelInput, in
engine/model_input.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from nanoserve import envs
from nanoserve.config import EngineConfig
from nanoserve.distributed.launcher import WorkerGroup, check_topology, run_ranks
from nanoserve.distributed.pipeline import layer_partition
from nanoserve.distributed.rank import Topology
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.layers.linear import divide, qkv_heads_per_rank
from nanoserve.models.config import ModelConfig


def check_tensor_parallel_support(model_config: ModelConfig, tp_size: int) -> None:
    """The linear layers' own checks (layers/linear.py), asked before any rank starts: a tensor
    parallel size that does not split the heads or the MLP is one clear error, not N ranks that
    each fail while building the model."""
    qkv_heads_per_rank(model_config.num_attention_heads, model_config.num_key_value_heads, tp_size)
    divide(model_config.intermediate_size, tp_size, "the model's {} MLP features")


def plan_topology(config: EngineConfig, model_config: ModelConfig) -> Topology:
    """This engine's ranks, checked: the model splits across the tensor-parallel ranks, and each
    pipeline stage's layers (EngineConfig.pp_layer_partition, else $NANOSERVE_PP_LAYER_PARTITION,
    else even)."""
    check_tensor_parallel_support(model_config, config.tensor_parallel_size)
    if model_config.moe is not None:  # experts split by their MLP features, or placed whole (EP)
        model_config.moe.check_tensor_parallel(
            config.tensor_parallel_size, config.enable_expert_parallel
        )
    partition = ()
    if config.pipeline_parallel_size > 1:
        spec = config.pp_layer_partition or envs.pp_layer_partition()
        partition = tuple(
            layer_partition(model_config.num_hidden_layers, config.pipeline_parallel_size, spec)
        )
    return check_topology(config, partition)


def run_worker(device: torch.device, config: EngineConfig, model_dir: str) -> None:
    """A rank > 0, after it joined the process group on `device` (launcher.WorkerGroup's target)."""
    runner = ModelRunner(
        config,
        ModelConfig.from_dir(model_dir, config.model_overrides, config.mmproj),
        Path(model_dir),
        device=device,
    )
    runner.worker_loop()


def start_workers(config: EngineConfig, topology: Topology, model_dir: str) -> WorkerGroup:
    """This host's ranks other than rank 0 (which is the calling engine)."""
    return WorkerGroup(topology, run_worker, (config, model_dir))


def run_node(config: EngineConfig, model_dir: str) -> int:
    """A host with --node-rank > 0 (`nanoserve serve --node-rank K`): run its ranks until rank 0
    stops them (or one fails); the exit code."""
    topology = plan_topology(
        config, ModelConfig.from_dir(model_dir, config.model_overrides, config.mmproj)
    )
    return run_ranks(topology, run_worker, (config, model_dir))
