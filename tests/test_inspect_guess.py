"""The guess of what a sample is (solar.layout.guess): a pure function of a file's metadata tree."""
import random

from hypothesis import given, settings, strategies as st

from solar.layout import LayoutSpec
from solar.layout.guess import (MAX_GUESSES, Node, guess_samples, is_metadata, no_field_reason, short_fields,
                                why_not_field)


def ds(path, shape, itemsize=4, dtype="float32", **kw):
    return Node(path, "dataset", shape=tuple(shape), dtype=dtype, itemsize=itemsize, **kw)


def edax_tree():
    """The shape of an EDAX h5ebsd file (kikuchipy's test data): 9 patterns with 14 per-point values, and header
    schematics bigger than the patterns."""
    data = "/Scan 1/EBSD/Data/"
    nodes = [ds("/ Manufacturer", (1,), 5, "string (5 bytes)", problem="strings"),
             ds(data + "Pattern", (9, 60, 60), 1, "uint8")]
    nodes += [ds(data + k, (9,)) for k in ("CI", "Fit", "IQ", "Phi", "Phi1", "Phi2", "X Position", "Y Position")]
    nodes += [ds(data + k, (9,), 1, "int8") for k in ("Phase", "Valid")]
    nodes += [ds(f"/Scan 1/EBSD/Header/Coordinate System/Schematic {i}", (351, 170, 3), 1, "uint8")
              for i in range(1, 5)]
    nodes += [ds("/Scan 1/EBSD/Header/Pattern Height", (1,), 4, "int32"),
              ds("/Scan 1/EBSD/Header/Phase/1/hkl Families", (69,), 40, "compound (6 fields)",
                 problem="compound type"),
              ds("/Scan 1/SEM-PRIAS Images/Data/SEM Image", (3, 3), 1, "uint8"),
              Node("/Scan 1", "group"), Node("/Scan 1/EBSD", "group")]
    return nodes


def test_ebsd_patterns_with_their_per_point_values_not_the_bigger_header_images():
    g = guess_samples(edax_tree())
    assert g[0].samples == 9
    assert g[0].fields[0] == "Scan 1/EBSD/Data/Pattern"  # the main array first, then by size and name
    assert set(g[0].fields) == {f"Scan 1/EBSD/Data/{k}" for k in ("Pattern", "CI", "Fit", "IQ", "Phi", "Phi1",
                                                                   "Phi2", "X Position", "Y Position",
                                                                   "Phase", "Valid")}
    assert g[1].fields == ("Scan 1/EBSD/Data/Pattern",) and "alone" in g[1].why
    assert g[2].fields == ("Scan 1/SEM-PRIAS Images/Data/SEM Image",) and g[2].samples == 3
    assert g[3].samples == 351 and len(g[3].fields) == 4 and "header/metadata" in g[3].why  # offered last


def test_a_nexus_signal_wins_over_bigger_arrays():
    nodes = [ds("/entry/data/data", (10, 4), 4), ds("/entry/data/x", (10,), 8),
             Node("/entry/data/signal_link", "link", target="/entry/instrument/det/frames", signal=True),
             ds("/entry/instrument/det/frames", (5, 100, 100), 2, "uint16"),
             ds("/entry/other/big", (7, 1000, 1000), 8, "float64")]
    g = guess_samples(nodes)
    assert g[0].fields == ("entry/instrument/det/frames",) and g[0].samples == 5  # signal through a soft link
    assert "NeXus signal" in g[0].why
    assert g[1].fields == ("entry/other/big",)


def test_scalars_one_value_strings_and_empty_datasets_are_never_fields():
    nodes = [ds("/a", ()), ds("/b", (1,)), ds("/c", (1, 1)), ds("/d", (0, 5)), ds("/e", (8,), problem="strings"),
             Node("/f", "dataset", shape=None, dtype="float32", itemsize=4), Node("/g", "group"),
             Node("/h", "link", target="/a")]
    assert [why_not_field(n) for n in nodes] == ["scalar", "one value", "one value", "empty", "strings",
                                                 "null dataspace", "group", "link"]
    assert guess_samples(nodes) == ()
    assert no_field_reason(nodes) == ("its 6 datasets: one value (2), empty (1), null dataspace (1), scalar (1), "
                                      "strings (1)")
    assert no_field_reason([Node("/x", "group"), Node("/y", "group")]) == "no dataset (2 groups)"
    assert no_field_reason([]) == "no dataset"
    assert no_field_reason([ds("/s", (3,), problem="compound type")]) == "its one dataset: compound type"


def test_two_scans_offer_the_first_scan_alone():
    nodes = [ds(f"/Scan {s}/EBSD/Data/{k}", shape, 1) for s in (1, 2)
             for k, shape in (("patterns", (6, 8, 8)), ("x", (6,)))]
    g = guess_samples(nodes)
    assert len(g[0].fields) == 4 and g[0].samples == 6
    assert g[1].fields == ("Scan 1/EBSD/Data/patterns",)
    assert g[2].fields == ("Scan 1/EBSD/Data/patterns", "Scan 1/EBSD/Data/x") and "under /Scan 1 only" in g[2].why


def test_metadata_paths():
    assert is_metadata("/Scan 1/EBSD/Header/x") and is_metadata("/EMheader/EBSD/Date")
    assert is_metadata("/Data/Image/1/Metadata") and is_metadata("/metadata/binning/steps")
    assert not is_metadata("/entry/data/data") and not is_metadata("/Scan 1/EBSD/Data/Pattern")


def test_short_fields_and_node_dict():
    assert short_fields(["a", "b", "c", "d", "e"]) == "a, b, c and 2 more"
    d = ds("/g/x", (3, 2), 8, "float64", chunks=(1, 2), filters=("gzip",), signal=True).to_dict()
    assert d == {"path": "/g/x", "kind": "dataset", "shape": [3, 2], "dtype": "float64", "chunks": [1, 2],
                 "filters": ["gzip"], "nbytes": 48, "stored_nbytes": 0, "field": True, "why_not_field": None,
                 "signal": True}
    assert Node("/l", "link", target="f.h5:/x").to_dict() == {"path": "/l", "kind": "link", "target": "f.h5:/x"}


# ------------------------------------------------------------------ properties
GROUPS = ("entry", "data", "Header", "scan_1", "meta", "instrument")


@st.composite
def trees(draw):
    n = draw(st.integers(0, 14))
    paths = draw(st.lists(st.lists(st.sampled_from(GROUPS), max_size=3).map(lambda g: "/".join(g)),
                          min_size=n, max_size=n))
    nodes = []
    for i, group in enumerate(paths):
        shape = tuple(draw(st.lists(st.sampled_from((0, 1, 2, 3, 5, 8)), max_size=3)))
        nodes.append(Node(f"/{group}/d{i}".replace("//", "/"), "dataset", shape=shape,
                          dtype="x", itemsize=draw(st.sampled_from((1, 2, 4, 8))),
                          problem=draw(st.sampled_from(("", "", "", "strings"))),
                          signal=draw(st.booleans()) and draw(st.booleans())))
    return nodes


def _key(nodes, n, meta):
    members = [m for m in nodes if not why_not_field(m) and m.shape[0] == n and is_metadata(m.path) == meta]
    return (any(m.signal for m in members), sum(m.nbytes for m in members), len(members), n)


@settings(max_examples=300, deadline=None)
@given(trees(), st.randoms(use_true_random=False))
def test_guess_properties(nodes, rnd):
    g = guess_samples(nodes)
    cands = {n.field_name: n for n in nodes if not why_not_field(n)}
    assert (len(g) == 0) == (len(cands) == 0)
    assert len(g) <= MAX_GUESSES and len({x.fields for x in g}) == len(g)  # no guess twice
    for x in g:
        assert x.fields and len(set(x.fields)) == len(x.fields)
        assert all(f in cands and cands[f].shape[0] == x.samples for f in x.fields)  # a shared leading length
        assert x.nbytes == sum(cands[f].nbytes for f in x.fields)
        LayoutSpec.from_dict(LayoutSpec("rows", ("f.h5",), x.fields).to_dict())  # a valid spec
    shuffled = list(nodes)
    rnd.shuffle(shuffled)
    assert guess_samples(shuffled) == g  # a function of the content, not of the walk's order
    if g:
        best = g[0]
        tier_meta = all(is_metadata(n.path) for n in cands.values())
        same = {f for f, n in cands.items() if n.shape[0] == best.samples and is_metadata(n.path) == tier_meta}
        assert set(best.fields) == same  # the whole set of that leading length, under any group
        for n in {c.shape[0] for c in cands.values() if is_metadata(c.path) == tier_meta}:
            assert _key(nodes, n, tier_meta) <= _key(nodes, best.samples, tier_meta)  # ranked first
        wrapped = [Node("/wrap" + n.path, n.kind, n.shape, n.dtype, n.itemsize, problem=n.problem,
                        signal=n.signal) for n in nodes]
        assert [(x.samples, tuple("wrap/" + f for f in x.fields)) for x in g if "under /" not in x.why] == \
            [(x.samples, x.fields) for x in guess_samples(wrapped) if "under /" not in x.why]  # any group depth


def test_guess_is_deterministic_on_a_big_random_tree():
    rnd = random.Random(3)
    nodes = [ds(f"/g{rnd.randrange(20)}/h{rnd.randrange(5)}/d{i}", (rnd.choice((2, 3, 100)), rnd.randrange(1, 9)),
                rnd.choice((1, 4))) for i in range(3000)]
    g = guess_samples(nodes)
    assert g == guess_samples(list(reversed(nodes)))
    assert g[0].samples in (2, 3, 100) and len(g) == 5  # 3 sets, the main array alone, one top-level group
