"""One behaviour on every path: each way a move can go gives what the plain oracle gives, and the same errors.

The oracle is ``tests/helpers.reference_move``: every container kind written out as plainly as it can be, with none
of the engine's code. The general memo walk, the fast gate, the optimistic host walk, the coalesced walk,
``pack().unpack()``, ``out=`` and the compiled move (default and ``fullgraph=True``) are each compared with it on
Hypothesis batches over every container kind: the same types, values, devices, dtypes and aliasing, the input
untouched.
"""

from __future__ import annotations

import collections
import re
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

import todevice
from tests import helpers, strategies
from todevice import _back, _move, _traced
from todevice._options import COALESCE_MAX_BYTES

pytestmark = pytest.mark.filterwarnings("ignore:Casting complex values to real discards:UserWarning")

DEVICES = ["cpu", "meta"]

# The compiled move recompiles for each example: a fortieth of the profile's examples, and never under 10 (50 in the
# thorough profile's 2,000).
COMPILED_EXAMPLES = max(10, settings.default.max_examples // 40)


def oracle(tree: Any, device: str, dtype: torch.dtype | None = None) -> Any:
    return helpers.reference_move(tree, device, dtype)


def general(tree: Any, device: str, dtype: torch.dtype | None = None) -> Any:
    """The general walk: the memo walk over every kind, nothing coalesced, no fast gate, no optimistic walk."""
    p = _move.plan_for(device, True, dtype)
    return _move._general(tree, p, False, COALESCE_MAX_BYTES, None, False)


def assert_same(actual: Any, expected: Any, device: str) -> None:
    helpers.assert_same_tree(actual, expected, values=device == "cpu")
    assert helpers.sharing(actual) == helpers.sharing(expected)


def moved_every_way(tree: Any, device: str, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Each path's result, by name; the input checked untouched after each."""
    before = helpers.snapshot(tree)
    p = _move.plan_for(device, True, dtype)
    ways = {
        "general walk": lambda: general(tree, device, dtype),
        "move": lambda: todevice.move(tree, device, dtype=dtype),
        "host walk": lambda: _move._host(tree, p, p.host_walk, True, COALESCE_MAX_BYTES),
        "coalesced": lambda: todevice.move(tree, device, dtype=dtype, coalesce=True),
        "not coalesced": lambda: todevice.move(tree, device, dtype=dtype, coalesce=False),
        "strict=False, keys to skip that no mapping has": lambda: todevice.move(
            tree, device, dtype=dtype, skip_keys=0.5
        ),
        "pack, unpack": lambda: todevice.pack(tree).unpack(device),
    }
    if dtype is not None:
        del ways["pack, unpack"]  # unpack() takes no dtype
    out = {}
    for name, way in ways.items():
        out[name] = way()
        helpers.assert_snapshot_equal(before, helpers.snapshot(tree))
    return out


@given(strategies.trees_with_aliases(), st.sampled_from(DEVICES), st.sampled_from([None, torch.float64]))
def test_every_eager_path_gives_the_oracle_s_result(tree: Any, device: str, dtype: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", todevice.errors.TensorsLeftBehindWarning)
        expected = oracle(tree, device, dtype)
        for name, got in moved_every_way(tree, device, dtype).items():
            try:
                assert_same(got, expected, device)
            except AssertionError as err:
                raise AssertionError(f"{name}: {err}") from err


plain_batches = st.recursive(
    st.sampled_from([0, 1, 2]),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text("ab", max_size=2), children, max_size=4),
    ),
    max_leaves=6,
)


@given(
    st.lists(strategies.tensors(requires_grad=False), min_size=1, max_size=3), plain_batches, st.sampled_from(DEVICES)
)
@settings(max_examples=60)
def test_the_fast_gate_gives_the_oracle_s_result_where_it_answers(pool: list[Any], shape: Any, device: str) -> None:
    """The gate (``_back.gate``) specialises the walk's rule for dict, list and tuple: where it answers, the answer is
    the oracle's; where it does not (a repeat, an atom, a nested container), the oracle's is what move() gives."""

    def build(x: Any) -> Any:
        if isinstance(x, int):
            return pool[x % len(pool)]
        if isinstance(x, dict):
            return {k: build(v) for k, v in x.items()}
        return type(x)(build(v) for v in x)

    batch = build(shape)
    for coalesce in (None, False):
        p = _move.plan_for(device, True, None)
        got = _back.gate(batch, p, coalesce)
        expected = oracle(batch, device)
        if got is not None:
            assert_same(got, expected, device)
        assert_same(todevice.move(batch, device, coalesce=coalesce), expected, device)


@given(strategies.trees_with_aliases(), st.booleans())
@settings(max_examples=50)
def test_out_gives_the_oracle_s_result(tree: Any, one_buffer: bool) -> None:
    # out='s targets: the same structure, its own tensors; views of one buffer (the few reads of a step) or not. Tied
    # tensors would give targets that share memory, which out= refuses (tests/test_into.py).
    tree = {k: v for k, v in tree.items() if k != "tied"}
    static = todevice.move(tree, "meta", coalesce=one_buffer)
    has_set = any(isinstance(node, (set, frozenset)) for _, node in todevice._walk.paths(tree))
    with torch.no_grad():  # out= copies without autograd, and says so for a tensor that requires grad
        if has_set:
            with pytest.raises(ValueError, match="set, whose items have no order"):
                todevice.move(tree, "meta", out=static)
            return
        assert todevice.move(tree, "meta", out=static) is static
    helpers.assert_same_tree(static, oracle(tree, "meta"))


def _compiled(tree: Any, fullgraph: bool) -> Any:
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's own warnings about graph breaks
        return torch.compile(lambda b: todevice.move(b, "cpu"), backend="eager", fullgraph=fullgraph)(tree)


@given(strategies.trees_with_aliases())
@settings(max_examples=COMPILED_EXAMPLES, deadline=None)
def test_the_compiled_move_gives_the_oracle_s_result(tree: Any) -> None:
    helpers.assert_same_tree(_compiled(tree, False), oracle(tree, "cpu"), values=True, same=False)


def _traced_containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The kinds the README lists as traced in one graph from torch 2.11; deques without a maxlen, which dynamo reads
    as None (docs/api.md says so)."""
    lists = st.lists(children, max_size=3)
    dicts = st.dictionaries(strategies.keys, children, max_size=3)
    return st.one_of(
        lists,
        lists.map(tuple),
        dicts,
        dicts.map(lambda d: collections.OrderedDict(sorted(d.items()))),
        dicts.map(lambda d: collections.defaultdict(list, d)),
        lists.map(collections.deque),
        st.tuples(children, children).map(lambda p: helpers.Point(*p)),
        st.tuples(children, children).map(lambda p: helpers.Record(*p)),
    )


traced_trees = st.recursive(
    st.one_of(strategies.tensors(requires_grad=False), st.integers(-5, 5), st.none()), _traced_containers, max_leaves=12
)


@pytest.mark.skipif(not _traced.TRACES, reason="dynamo traces move() from torch 2.11")
@given(traced_trees)
@settings(max_examples=COMPILED_EXAMPLES, deadline=None)
def test_fullgraph_traces_the_readme_s_kinds_and_gives_the_oracle_s_result(tree: Any) -> None:
    helpers.assert_same_tree(_compiled(tree, True), oracle(tree, "cpu"), values=True, same=False)


# ---------------------------------------------------------------- the same error on every path


class Refusing:
    def __init__(self, x: Any) -> None:
        self.x = x


@pytest.fixture
def refusing() -> Any:
    def unflatten(aux: Any, children: list[Any]) -> Any:
        raise RuntimeError("no rebuild")

    todevice.register(Refusing, lambda r: ([r.x], None), unflatten)
    yield
    todevice.unregister(Refusing)


@pytest.mark.usefixtures("refusing")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "how",
    [{}, {"coalesce": True}, {"coalesce": False}, {"strict": True}, {"skip_keys": "z"}, {"dtype": torch.float64}],
    ids=lambda h: ",".join(h) or "default",
)
def test_every_path_names_the_same_failing_node(device: str, how: dict[str, Any]) -> None:
    batch = {"a": [torch.ones(1), {"b": Refusing(torch.ones(2))}], "c": torch.zeros(1)}
    with pytest.raises(RuntimeError, match=r"Cannot move \['a'\]\[1\]\['b'\] \(Refusing\).*no rebuild"):
        general(batch, device)
    with pytest.raises(RuntimeError, match=r"Cannot move \['a'\]\[1\]\['b'\] \(Refusing\).*no rebuild"):
        todevice.move(batch, device, **how)
    with pytest.raises(RuntimeError, match=r"\['a'\]\[1\]\['b'\].*no rebuild"):
        todevice.pack(batch).unpack(device)


# ---------------------------------------------------------------- every option's error, eager and compiled

BAD_OPTIONS = [
    {"device": "cuda0"},
    {"device": ["meta"]},
    {"device": -1},
    {"non_blocking": "yes"},
    {"non_blocking": 1},
    {"dtype": torch.int64},
    {"dtype": "float16"},
    {"coalesce": "yes"},
    {"coalesce_max_bytes": -1},
    {"coalesce_max_bytes": 1.5},
    {"stream": "side"},
    {"strict": "yes"},
    {"skip_keys": [[1]]},
]


def _raised(fn: Any, options: dict[str, Any]) -> tuple[type[BaseException], str]:
    options = dict(options)
    device = options.pop("device", "meta")
    try:
        fn({"x": torch.ones(2)}, device, **options)
    except Exception as err:
        return type(err), str(err)
    raise AssertionError("no error")


@pytest.mark.parametrize("options", BAD_OPTIONS, ids=lambda o: "=".join(map(str, next(iter(o.items())))))
def test_a_bad_option_gives_eager_s_error_compiled_and_everywhere(options: dict[str, Any]) -> None:
    eager = _raised(todevice.move, options)

    def step(b: Any, d: Any, **o: Any) -> Any:
        return todevice.move(b, d, **o)

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _raised(torch.compile(step, backend="eager"), options) == eager
        torch._dynamo.reset()
        _, text = _raised(torch.compile(step, backend="eager", fullgraph=True), options)
    if _traced.TRACES:
        assert eager[1].split(":")[0] in text  # fullgraph=True raises dynamo's error, eager's message inside
    else:  # before torch 2.11, move() runs outside the graph, which fullgraph=True refuses, naming the release
        assert "traces from torch 2.11" in text
    into = dict(options, out={"x": torch.ones(2, device="meta")})
    assert _raised(todevice.move, into) == eager  # out= checks its options by the same rule
    if set(options) <= {"device", "non_blocking", "skip_keys"}:
        device = options.get("device", "meta")
        rest = {k: v for k, v in options.items() if k != "device"}
        with pytest.raises(eager[0], match=re.escape(eager[1].split(":")[0])):
            todevice.prefetch([], device, **rest)
        if "device" in options:
            with pytest.raises(eager[0], match=re.escape(eager[1].split(":")[0])):
                todevice.collate(device=device)
