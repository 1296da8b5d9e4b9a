"""Upper bounds on a layout's size, checked from declared shapes before any array is allocated.

A damaged header (or a sparse dataset declared huge) can ask for a block map
of 10^12 entries; solar refuses such a layout with a LayoutError naming the
count and the limit instead of trying to allocate it.  The block map costs
about 32 bytes per block, 8 per sample and 8 per sample->block link.
"""
from __future__ import annotations

import os
from typing import Sequence

from ..errors import LayoutError

MAX_BLOCKS = 1 << 27
"""Most blocks (chunks, or byte ranges of contiguous data) in one layout: ~4 GiB of block map."""
MAX_SAMPLES = 1 << 30
"""Most samples in one layout."""
MAX_LINKS = 1 << 30
"""Most sample->block links (``Layout.sample_blocks`` entries) in one layout: 8 GiB."""
MAX_BLOCK_BYTES = 1 << 34
"""Largest decoded block (what one buffer slot holds): 16 GiB."""


def check_count(n: int, limit: int, what: str, where: str) -> None:
    """LayoutError if ``n`` things (blocks, samples, links) exceed ``limit``."""
    if n > limit:
        raise LayoutError(f"{where} would need {n:,} {what}, more than solar's limit of {limit:,} "
                          f"(damaged header, or a dataset declared far bigger than its data; re-chunk it)")


def grid_size(shape: Sequence[int], block_shape: Sequence[int]) -> int:
    """Number of blocks of a dataset (exact Python int, no overflow)."""
    n = 1
    for s, c in zip(shape, block_shape):
        n *= -(-int(s) // int(c))
    return n


def links_per_sample(shape, block_shape, roles: str, window: int) -> int:
    """Upper bound on the blocks one sample touches in one field (see :mod:`solar.layout.blocks`)."""
    other = grid_size(shape[len(roles):], block_shape[len(roles):])
    if "t" in roles:
        ax = roles.index("t")
        return other * min(int(window), -(-int(shape[ax]) // int(block_shape[ax])))
    return other


def check_layout_size(datasets, block_shapes, sources, files: Sequence[str]) -> None:
    """Refuse a layout whose blocks, block bytes, samples or links exceed the limits, or whose
    sample count is negative.

    ``datasets``: DatasetInfo list; ``block_shapes``: one block shape per dataset;
    ``sources``: :class:`~solar.layout.sources.Source` list; ``files``: for the message.
    """
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    where = f"the layout of {', '.join(os.path.basename(p) for p in files[:3])}{more}"
    for src in sources:
        if src.n_samples < 0:
            raise LayoutError(f"{os.path.basename(files[src.file])} gives a negative sample count "
                              f"({src.n_samples}; damaged attributes?)")
    check_count(sum(grid_size(i.shape, b) for i, b in zip(datasets, block_shapes)), MAX_BLOCKS, "blocks", where)
    for info, shp in zip(datasets, block_shapes):
        nbytes = grid_size(shp, [1] * len(shp)) * info.itemsize
        check_count(nbytes, MAX_BLOCK_BYTES, "bytes in one block", f"{os.path.basename(files[info.file])}:/"
                    f"{info.name.lstrip('/')} (blocks of shape {tuple(shp)})")
    check_count(sum(src.n_samples for src in sources), MAX_SAMPLES, "samples", where)
    links = sum(src.n_samples * sum(links_per_sample(datasets[d].shape, block_shapes[d], r, src.window)
                                    for d, r in zip(src.datasets, src.roles)) for src in sources)
    check_count(links, MAX_LINKS, "sample->block links", where)
