"""Serve-time options and the GPUStack backend description."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dsinfer.config import ConfigError
from dsinfer.parallel.config import ParallelConfig
from dsinfer.server.launch import ServeOptions

BACKEND = Path(__file__).resolve().parents[1] / "deploy" / "gpustack" / "dsinfer-backend.yaml"


@pytest.mark.parametrize(("dp", "ep", "cp"), [(2, 4, 1), (1, 2, 1), (4, 4, 2)])
def test_parallel_sizes_must_tile(dp, ep, cp):
    with pytest.raises(ConfigError, match=rf"got {dp} x {cp} != {ep}"):
        ServeOptions(None, parallel=ParallelConfig(dp, ep, cp))


def test_the_flags_give_the_rank_layout():
    layout = ServeOptions(None, parallel=ParallelConfig(data_parallel_size=4, expert_parallel_size=4, nnodes=2,
                                                        node_rank=1, master_port=29500)).parallel  # fmt: skip
    assert (layout.world_size, layout.ranks_per_node, list(layout.local_ranks)) == (4, 2, [2, 3])
    assert not ServeOptions(None).parallel.is_multi_rank  # one rank: in-process, as before
    with pytest.raises(ConfigError, match="context parallelism is not available yet"):
        ServeOptions(None, parallel=ParallelConfig(1, 2, 2))


def test_gpustack_backend_runs_dsinfer_serve():
    backend = yaml.safe_load(BACKEND.read_text())
    assert backend["health_check_path"] == "/health"
    command = backend["version_configs"][backend["default_version"]]["run_command"]
    for placeholder in ("{{model_path}}", "{{port}}", "{{gpu_count}}"):
        assert placeholder in command and placeholder in backend["default_run_command"]
    assert command.startswith("dsinfer serve {{model_path}}")
    assert all(param.startswith("--") for param in backend["default_backend_param"])
