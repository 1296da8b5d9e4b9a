"""Offline planner: DistributedSampler's global index, per-step assignment of samples to ranks,
and per-rank buffer plans (Belady on the known future), plus the what-if policy simulator.
Node pools (ranks of a node sharing one buffer) and peer transfers between nodes: :mod:`.nodes`,
:mod:`.peer_engine`, :mod:`.node_plan`.

Pure: arrays in, arrays out (torch only for ``randperm``); no I/O, no MPI, no clock.
The schedule file and ``solar plan`` build on :func:`run_policy` (open issue).
"""
from .numba_cache import install as _install_numba_cache

_install_numba_cache()  # before any kernel compiles: every solar import passes here (solar/__init__ plans)

from .config import PlanConfig, parse_bytes  # noqa: E402
from .node_plan import NodePlan, plan_nodes  # noqa: E402
from .nodes import NodeMap, PeerCost  # noqa: E402
from .policies import ALL_POLICIES, NODE_POLICIES, POLICIES, Policy, get_policy  # noqa: E402
from .run import BufferTooSmall, Demand, EpochPlan, PolicyResult, run_policy  # noqa: E402
from .sampler import batch_bounds, epoch_indices, sampler_sizes, steps_per_epoch  # noqa: E402
from .simulate import simulate  # noqa: E402

__all__ = ["PlanConfig", "parse_bytes", "POLICIES", "NODE_POLICIES", "ALL_POLICIES", "Policy", "get_policy",
           "NodeMap", "PeerCost", "NodePlan", "plan_nodes", "BufferTooSmall", "Demand",
           "EpochPlan", "PolicyResult", "run_policy", "batch_bounds", "epoch_indices", "sampler_sizes",
           "steps_per_epoch", "simulate"]
