"""Dataset layouts: where each sample's bytes live, as blocks (HDF5 chunks or byte ranges).

``load_layout(path)`` accepts a spec file, a folder holding ``solar-layout.json``
or a single HDF5 file (the spec is then guessed).
"""
from .blocks import chunk_grid, field_chunk_lists, merge_fields, virtual_chunks
from .build import build_layout, open_h5
from .detect import detect_spec, find_spec
from .layout import Layout
from .spec import KINDS, SPEC_FILENAME, LayoutSpec


def load_layout(path: str, progress: bool = False, split=None, fields=None) -> Layout:
    """Build the :class:`Layout` of a spec file, a folder with a spec, or an HDF5 file;
    ``split``/``fields``: of that split / those fields only (:meth:`LayoutSpec.select`)."""
    return build_layout(find_spec(path).select(split, fields), progress=progress)


__all__ = ["Layout", "LayoutSpec", "KINDS", "SPEC_FILENAME", "build_layout", "load_layout", "find_spec",
           "detect_spec", "open_h5", "chunk_grid", "field_chunk_lists", "merge_fields", "virtual_chunks"]
