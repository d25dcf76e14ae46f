"""A SLURM batch script that runs a plan: one `parallax run` (one torchrun agent) per node.

The script asks SLURM for the plan's nodes with one task each and its GPUs per
node; `srun` starts one task per node, and each task's `parallax run` starts
torchrun for that node's ranks, all meeting at torchrun's c10d rendezvous on the
allocation's first node. The rendezvous id is the SLURM job id, so a requeued job
meets afresh. With `--max-restarts` torchrun's elastic agent restarts the workers
after a failure and they resume from the newest valid checkpoint; with `min_nodes`
below the plan's node count the job goes on when nodes are lost, re-planned for the
ranks that are left (executor/runtime/elastic.py).

NCCL's environment follows the profile's fabric (variable names as NCCL's
environment-variable documentation gives them); the CPU profile runs gloo.
"""
from __future__ import annotations

import re
import shlex
import sys

from layout.plan import Plan
from hardware.errors import PlanError

RDZV_PORT = 29500  # torchrun's documented default master port

# What each fabric needs from NCCL beyond its defaults; "#" lines are printed as comments.
FABRIC_ENV: dict[str, list[str]] = {
    "infiniband": [
        "# InfiniBand: NCCL's IB verbs transport (NCCL_IB_DISABLE=0 is its default; stated so that a site",
        "# profile exporting 1 does not silently fall back to sockets). Set NCCL_IB_HCA to pin the HCAs.",
        "export NCCL_IB_DISABLE=0",
    ],
    "ethernet": [
        "# Ethernet without RDMA: NCCL's socket transport. Name the data interface with NCCL_SOCKET_IFNAME.",
        "export NCCL_IB_DISABLE=1",
    ],
    "roce": [
        "# RoCE: NCCL's IB verbs transport over Ethernet; the GID index of RoCE v2 is usually 3.",
        "export NCCL_IB_DISABLE=0",
        "export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}",
    ],
}
COMMON_ENV = [
    "# A peer that died aborts the collectives instead of hanging them, so torchrun can restart the job.",
    "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
    "# One TCPStore per restart attempt: restarted gloo workers reconnect reliably (torch 2.13).",
    "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
]


def batch_script(plan: Plan, plan_path: str, *, steps: int, checkpoint_dir: str | None, checkpoint_every: int,
                 max_restarts: int, min_nodes: int | None = None, job_name: str | None = None,
                 python: str | None = None, port: int = RDZV_PORT, trust_module: bool = False) -> str:
    """The sbatch script's text for `plan` (saved at `plan_path`, a path every node can read)."""
    if plan.groups:
        raise PlanError("plan", "a mixed-cluster plan needs a SLURM heterogeneous job (one component per GPU type), "
                        "which `launch --slurm` does not write", "start `parallax run` on each node with --nnodes, "
                        "--node-rank (the groups' nodes in the plan's rank order) and --rdzv-endpoint")
    cluster = plan.cluster()
    per_node = min(cluster.gpus_per_node, plan.n_gpus)
    if plan.n_gpus % per_node:
        raise PlanError("plan", f"{plan.n_gpus} ranks do not fill nodes of {per_node}", "plan a multiple of the node size")
    nodes = plan.n_gpus // per_node
    low = nodes if min_nodes is None else min_nodes
    if not 1 <= low <= nodes:
        raise PlanError("min_nodes", f"{low} is not between 1 and the plan's {nodes} nodes", f"use 1..{nodes}")
    gpu = cluster.gpu.device_type == "cuda"  # a calibrated CPU profile is named calibrated-cpu
    run = [python or sys.executable, "-m", "parallax_cli", "run", plan_path, "--steps", str(steps),
           "--nproc", str(per_node), "--nnodes", f"{low}:{nodes}" if low < nodes else str(nodes)]
    if checkpoint_dir:
        run += ["--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(checkpoint_every)]
    if max_restarts:
        run += ["--max-restarts", str(max_restarts)]
    if trust_module:
        run += ["--trust-module"]
    command = " ".join(shlex.quote(part) for part in run)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={_job_name(job_name or 'parallax-' + plan.model)}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={per_node}"] if gpu else []),
        "#SBATCH --exclusive",
        _comment(f"{plan.layout_tag} on {plan.n_gpus} x {cluster.gpu.name}: {nodes} node(s) of {per_node}"),
        "set -euo pipefail",
        "",
        *(FABRIC_ENV.get(cluster.inter_fabric, FABRIC_ENV["ethernet"]) if gpu else
          ["# CPU ranks: gloo; name the data interface with GLOO_SOCKET_IFNAME if there are several."]),
        *COMMON_ENV,
        "",
        "# The rendezvous (torchrun's c10d) on the allocation's first node",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export PARALLAX_RDZV=\"$head:{port}\"",
        "",
        "# One task per node; each starts torchrun for its node's ranks",
        f"srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c "
        + shlex.quote(f'exec {command} --node-rank "$SLURM_NODEID" --rdzv-endpoint "$PARALLAX_RDZV" '
                      f'--rdzv-id "parallax-$SLURM_JOB_ID"'),
        "",
    ]
    return "\n".join(lines)


def _job_name(name: str) -> str:
    """A job name sbatch reads as one word: what is not a letter, digit, '.', '_' or '-' becomes '-'."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)[:64]


def _comment(text: str) -> str:
    """A comment line that stays one line (names are checked where they are read; this holds anyway)."""
    return "# " + re.sub(r"[\x00-\x1f\x7f]", " ", text)
