"""Plan digests: the planner's output on many random jobs, hashed and compared with digests recorded earlier.

A change meant to leave plans alone (a restructured kernel, a faster loop) must keep every digest: the sha256
of every array and count the planner hands out (each epoch's plan: indices, rank or node of each position,
per-step counts, load/evict/stage lists and transfers; the run's per-epoch totals), or the error it raised.

Configurations (:func:`configs`) come from a fixed hash, not from an RNG library, so they are the same on any
machine: every policy of the registry (node and peer policies with several ranks per node included), several
layouts (co-chunk samples, samples of several blocks, overlapping windows, irregular blocks with compressed
sizes), world sizes 1-8, local batches, budgets from too small to the whole data set, epochs, seeds,
``drop_last``, ``epsilon``, planning with and without block groups and recording, open-ended plans made in
windows, and jobs resumed mid-epoch (``first_step``).

Record again (only when plans are meant to change, saying why in the commit)::

    python tests/test_plan_digests.py --record
"""
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import fields

import numpy as np
import pytest

from solar.errors import SolarError
from solar.scheduler.config import PlanConfig
from solar.scheduler.nodes import NodeMap, PeerCost
from solar.scheduler.policies import ALL_POLICIES
from solar.scheduler.run import Demand, PlanRun

DIGESTS = os.path.join(os.path.dirname(__file__), "data", "plan_digests.json")
N_CONFIGS = 600
MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a fixed 64-bit hash of x."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


class _Draw:
    """Numbers drawn from a fixed hash of (configuration, draw count)."""

    def __init__(self, i: int):
        self.state = _mix(i + 1)

    def int(self, lo: int, hi: int) -> int:  # lo..hi inclusive
        self.state = _mix(self.state)
        return lo + self.state % (hi - lo + 1)

    def pick(self, options):
        return options[self.int(0, len(options) - 1)]


def _hash_ints(n: int, seed: int) -> np.ndarray:
    """uint64[n]: splitmix64 of 0..n-1 under ``seed`` (vectorised, the same on every machine)."""
    with np.errstate(over="ignore"):
        x = np.arange(n, dtype=np.uint64) + np.uint64(_mix(seed))
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def make_demand(spec: tuple) -> Demand:
    kind = spec[0]
    if kind == "syn":  # (n, sample bytes, samples per block, blocks per sample)
        return Demand.synthetic(*spec[1:])
    if kind == "win":  # Well-like windows: sample i of a trajectory uses frames i .. i + frames - 1
        _, traj, steps, frames, seed = spec
        per = steps - frames + 1
        t = np.repeat(np.arange(traj, dtype=np.int64), per)
        i = np.tile(np.arange(per, dtype=np.int64), traj)
        blocks = ((t * steps + i)[:, None] + np.arange(frames)).reshape(-1)
        nb = 32 + (_hash_ints(traj * steps, seed) % np.uint64(97)).astype(np.int64)
        ptr = np.arange(0, blocks.shape[0] + 1, frames, dtype=np.int64)
        return Demand(ptr, blocks, nb, nb.copy())
    # irregular: sample i uses k_i in 0..kmax consecutive blocks from a hashed start (shared, overlapping),
    # block sizes vary, stored sizes from 1/40 (sent rather than read) to all of the decoded bytes
    _, n, n_blocks, kmax, seed = spec
    h = _hash_ints(3 * n + 2 * n_blocks, seed)
    k = (h[:n] % np.uint64(kmax + 1)).astype(np.int64)
    k[0] = max(1, k[0])
    start = (h[n:2 * n] % np.uint64(n_blocks)).astype(np.int64)
    ptr = np.concatenate(([0], np.cumsum(k))).astype(np.int64)
    blocks = np.concatenate([np.sort((s + np.arange(c)) % n_blocks) for s, c in zip(start, k)]).astype(np.int64)
    nb = 16 + (h[3 * n:3 * n + n_blocks] % np.uint64(200)).astype(np.int64)
    ratio = 1 + (h[3 * n + n_blocks:] % np.uint64(40)).astype(np.int64)
    return Demand(ptr, blocks, nb, np.maximum(1, nb // ratio))


def configs():
    """``N_CONFIGS`` configurations ``(key, policy, dict)``, the policies taken in turn."""
    names = list(ALL_POLICIES)
    out = []
    for i in range(N_CONFIGS):
        d = _Draw(i)
        pol = ALL_POLICIES[names[i % len(names)]]
        kind = d.pick(["syn", "syn", "win", "rnd"])
        if kind == "syn":
            dem = ("syn", d.int(6, 300), d.pick([1000, 4096, 12288]), d.pick([1, 1, 2, 4]), d.pick([1, 1, 3]))
        elif kind == "win":
            dem = ("win", d.int(1, 4), d.int(6, 40), d.int(2, 6), d.int(0, 999))
        else:
            dem = ("rnd", d.int(8, 250), d.int(4, 120), d.int(1, 4), d.int(0, 999))
        P = d.pick([1, 2, 2, 3, 4, 4, 6, 8])
        L = d.pick([L for L in range(1, P + 1) if P % L == 0]) if pol.node_pools else 1
        cfg = dict(P=P, L=L, b=d.int(1, 6), E=d.int(1, 4), f=d.pick([0.02, 0.1, 0.25, 0.5, 0.5, 0.75, 1.0, 1.5]),
                   seed=d.pick([0, 1, d.int(2, 10**6), 2**40 + d.int(0, 99)]), drop_last=d.int(0, 1) == 1,
                   eps=d.pick([0.0, 0.0, 0.25]), group=d.int(0, 5) > 0, record=d.int(0, 5) > 0,
                   cost=d.pick(["default", "default", "slow-net"]), run="fixed", window=0, first_step=0)
        windowed = pol.epoch_order == "identity" and not (pol.next_use != "none" and pol.lookahead is None)
        how = d.int(0, 5)
        if how <= 1 and windowed:
            cfg.update(run="windows", window=d.int(1, 2), record=True)
        elif how == 2 and not pol.node_pools:
            cfg.update(run="resume", first_step=d.int(1, 9), record=True)
        cfg["demand"] = dem
        out.append((f"{i:03d}-{pol.name}", pol.name, cfg))
    return out


def _update(h, name: str, v):
    h.update(name.encode())
    if v is None:
        h.update(b"none")
    elif isinstance(v, np.ndarray):
        h.update(f"{v.dtype.str}{v.shape}".encode())
        h.update(np.ascontiguousarray(v).tobytes())
    elif isinstance(v, (list, tuple)):
        h.update(f"[{len(v)}]".encode())
        for j, x in enumerate(v):
            _update(h, f"{name}.{j}", x)
    elif isinstance(v, (bool, int, np.integer)):
        h.update(str(int(v)).encode())
    elif isinstance(v, (float, str, NodeMap)):
        h.update(repr(v).encode())
    else:
        raise TypeError(f"cannot hash {name} of type {type(v).__name__}")


def plan_digest(policy: str, c: dict) -> str:
    """sha256 of everything the planner outputs for configuration ``c`` (or of the error it raises)."""
    demand = make_demand(c["demand"])
    P = c["P"]
    nb = demand.block_nbytes
    sample_bytes = np.array([int(nb[demand.sample_blocks[demand.sample_ptr[s]:demand.sample_ptr[s + 1]]].sum())
                             for s in range(demand.n_samples)])
    total = int(sample_bytes.sum())
    budget = int(c["f"] * total / P)
    epochs = c["E"] + (c["first_step"] > 0)
    cfg = PlanConfig(P, c["b"], epochs, budget, c["seed"], c["drop_last"], c["eps"])
    cost = PeerCost() if c["cost"] == "default" else PeerCost(network_bytes_per_s=1e9, storage_bytes_per_s=2e9)
    pol = ALL_POLICIES[policy]
    nodes = NodeMap(P, c["L"]) if pol.node_pools else None
    h = hashlib.sha256()
    plans = []
    try:
        run = PlanRun(demand, cfg, policy, record=c["record"], group_blocks=c["group"],
                      open_ended=c["run"] == "windows", nodes=nodes, cost=cost)
        first = min(c["first_step"], run.S - 1)
        results = []
        if c["run"] == "windows":
            stop = 0
            while stop < c["E"]:
                stop = min(c["E"], stop + c["window"])
                results.append(run.advance(stop, on_epoch=plans.append))
        else:
            results.append(run.advance(epochs, on_epoch=plans.append, first_step=first))
        for j, res in enumerate(results):
            for f in fields(res):
                _update(h, f"result{j}.{f.name}", getattr(res, f.name))
    except SolarError as exc:
        _update(h, "error", f"{type(exc).__name__}: {exc}")
    for j, ep in enumerate(plans):
        for f in fields(ep):
            _update(h, f"epoch{j}.{f.name}", getattr(ep, f.name))
    return h.hexdigest()[:32]  # 128 bits


CONFIGS = configs()


@pytest.fixture(scope="module")
def recorded():
    with open(DIGESTS) as fh:
        return json.load(fh)


def test_recorded_digests_cover_every_configuration_and_policy(recorded):
    assert sorted(recorded["digests"]) == sorted(k for k, _, _ in CONFIGS)
    assert {p for _, p, _ in CONFIGS} == set(ALL_POLICIES)


@pytest.mark.parametrize("key,policy,c", CONFIGS, ids=[k for k, _, _ in CONFIGS])
def test_plan_digest_unchanged(recorded, key, policy, c):
    assert plan_digest(policy, c) == recorded["digests"][key], f"the plan of {key} changed: {c}"


def _record():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "solar/scheduler"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    out = {"recorded_from": commit + (" (solar/scheduler modified)" if dirty else ""),
           "digests": {key: plan_digest(p, c) for key, p, c in CONFIGS}}
    with open(DIGESTS, "w") as fh:
        json.dump(out, fh, indent=0, sort_keys=True)
        fh.write("\n")
    print(f"{len(out['digests'])} digests recorded from {out['recorded_from']} in {DIGESTS}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(__doc__)
    _record()
