"""A 30-epoch run of 2 ranks at buffer fraction 0.5: resident memory flat after epoch 2,
measured hit bytes per epoch equal to the schedule's prediction, no plan violation, and
per-step statistics kept in a bounded ring (exact totals)."""
import inspect

import pytest

import solar
from solar.bench.solar_run import rss_bytes
from solar.buffer import BufferManager
from solar.loader import SolarLoader

from helpers import make_dataset

EPOCHS, RANKS = 30, 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    data = make_dataset(root, "ptychonn", "chunked", samples=24)
    path = str(root / "plan.h5")
    solar.plan(data, world_size=RANKS, local_batch=2, epochs=EPOCHS, buffer_fraction=0.5, out=path).close()
    return path, data


def test_thirty_epochs_flat_memory_planned_hits(job):
    loaders = [SolarLoader(*job, rank=r, as_torch=False, prefetch=2, threads=2) for r in range(RANKS)]
    rss, hit_bytes, prev = [], [], [dict() for _ in loaders]
    try:
        for e in range(EPOCHS):
            for r, loader in enumerate(loaders):  # the two ranks, one epoch each in turn
                loader.set_epoch(e)
                for _ in loader:
                    pass
            stats = [ld.stats() for ld in loaders]
            hit_bytes.append(sum(st["hit_bytes"] - p.get("hit_bytes", 0) for st, p in zip(stats, prev)))
            prev = stats
            rss.append(rss_bytes())
        predicted = loaders[0].schedule.predicted()["hit_bytes"]
        assert all(st["plan_violations"] == 0 for st in prev)
        assert all(len(ld.buffer.totals.per_step) <= BufferManager.KEEP_STEP_STATS for ld in loaders)
    finally:
        for ld in loaders:
            ld.close()
    print("RSS MiB per epoch:", " ".join(f"{x / 2**20:.1f}" for x in rss))
    assert hit_bytes == [int(x) for x in predicted]
    growth = max(rss[2:]) - rss[2]
    assert growth < 4 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB after epoch 2"


def test_step_stats_are_a_bounded_ring(job):
    assert isinstance(inspect.signature(BufferManager).parameters["keep_step_stats"].default, int)
    with SolarLoader(*job, rank=0, as_torch=False) as loader:
        loader._start_buffer = lambda: setattr(loader, "buffer", BufferManager(
            loader.rank_plan, loader.demand, loader.reader, loader._batch, budget=loader.schedule.buffer_bytes,
            start=loader.cursor, keep_step_stats=5))
        for e in range(3):
            loader.set_epoch(e)
            n = sum(len(b["index"]) for b in loader)
        t = loader.buffer.totals
        assert [s.step for s in t.per_step] == list(range(3 * loader.S - 5, 3 * loader.S))
        assert t.steps == 3 * loader.S and n > 0
