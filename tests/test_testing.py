"""todevice.testing: the strategies make every kind, assert_moved() catches each wrong move, compare() finds them."""

from __future__ import annotations

import ast
import collections
import dataclasses
import importlib
import pickle
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings

import todevice
import todevice.testing as tt
from tests import strategies
from todevice.testing import FrozenMapping, Pair, Record, TaggedDict, TaggedList, assert_moved, batches, compare

META = torch.device("meta")


class Sub(torch.Tensor):
    """A tensor subclass, which a move keeps."""


def recursive_to_device(data: Any, device: Any) -> Any:
    """The helper every training loop carries."""
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, dict):
        return {k: recursive_to_device(v, device) for k, v in data.items()}
    if isinstance(data, list):
        return [recursive_to_device(v, device) for v in data]
    return data


# ---------------------------------------------------------------- the module


def test_only_todevice_testing_imports_hypothesis() -> None:
    src = Path(todevice.__file__).parent
    for path in src.glob("*.py"):
        if path.name == "testing.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = node.module if isinstance(node, ast.ImportFrom) else None
            assert not any(n.startswith("hypothesis") for n in names), path.name
            assert module is None or not module.startswith("hypothesis"), path.name
            assert "todevice.testing" not in names and "testing" not in names, path.name


def test_without_hypothesis_the_import_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # what an absent package looks like to import
    monkeypatch.delitem(sys.modules, "todevice.testing")
    with pytest.raises(ImportError, match="pip install hypothesis"):
        importlib.import_module("todevice.testing")


def test_project_strategies_use_the_public_ones() -> None:
    assert strategies.tensors is tt.tensors
    assert strategies.batches is tt.batches
    assert list(tt.DTYPES) == strategies.DTYPES


# ---------------------------------------------------------------- strategies


def features(batch: Any) -> set[str]:
    """What a batch holds: container kinds and their variants, tensor traits, atoms, aliasing."""
    found: set[str] = set()
    tensors: list[torch.Tensor] = []

    def go(x: Any) -> None:
        tp = type(x)
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            found.add(str(x.dtype))
            found.update(
                name
                for name, present in [
                    ("0-dim", x.dim() == 0),
                    ("empty", x.numel() == 0),
                    ("non-contiguous", not x.is_contiguous()),
                    ("requires_grad", x.requires_grad),
                ]
                if present
            )
            return
        children: list[Any] = []
        if tp is dict:
            found.add("dict")
        elif tp is collections.OrderedDict:
            found.add("OrderedDict")
            if list(x) != list(dict.keys(x)):
                found.add("OrderedDict reordered")
        elif tp is collections.defaultdict:
            found.add("defaultdict")
        elif tp is TaggedDict:
            found.add("dict subclass")
            children.append(x.tag)
            if not isinstance(x.tag, str):
                found.add("attribute holding more than a string")
        elif tp in (collections.UserDict, FrozenMapping):
            found.update({"Mapping", tp.__name__})
        if isinstance(x, collections.abc.Mapping):
            children += list(x.values())
        elif tp in (list, tuple, set, frozenset, collections.deque, Pair, TaggedList, collections.UserList) or (
            tp is torch.return_types.max
        ):
            kinds = {TaggedList: "list subclass", collections.UserList: "list subclass", Pair: "namedtuple"}
            found.add(kinds.get(tp, "torch.return_types" if tp is torch.return_types.max else tp.__name__))
            if tp is collections.UserList:
                found.add("UserList")
            if tp is TaggedList:
                children.append(x.tag)
            if tp is collections.deque and x.maxlen is not None:
                found.add("deque maxlen")
            children += list(x)
        elif dataclasses.is_dataclass(x):
            found.update({"dataclass", tp.__name__})
            children = [getattr(x, f.name) for f in dataclasses.fields(x)]
            if tp is Record and x.extra is not None:
                found.add("init=False field")
            if tp is Record and "note" in vars(x):
                found.add("attribute that is no field")
                children.append(x.note)
        else:
            found.add(f"atom {tp.__name__}")
        for child in children:
            go(child)

    go(batch)
    if len({id(t) for t in tensors}) < len(tensors):
        found.add("the same tensor twice")
    by_ptr = collections.Counter((t.data_ptr(), t.shape, t.stride()) for t in {id(t): t for t in tensors}.values())
    if any(n > 1 and ptr for (ptr, _, _), n in by_ptr.items()):
        found.add("distinct tensors over the same memory")
    return found


EXPECTED_FEATURES = [
    *tt.KINDS,
    "OrderedDict reordered",
    "deque maxlen",
    "Record",
    "FrozenRecord",
    "SlotsRecord",
    "FrozenSlotsRecord",
    "init=False field",
    "attribute that is no field",
    "attribute holding more than a string",
    "UserList",
    "UserDict",
    "FrozenMapping",
    *(str(d) for d in tt.DTYPES),
    "0-dim",
    "empty",
    "non-contiguous",
    "requires_grad",
    *(
        f"atom {name}"
        for name in ["NoneType", "bool", "int", "float", "str", "bytes", "Color", "dtype", "device", "Size"]
    ),
    "the same tensor twice",
    "distinct tensors over the same memory",
]


def test_batches_make_every_kind() -> None:
    found: collections.Counter[str] = collections.Counter()

    # Derandomized: the same 300 batches on every run, so a feature made rarely cannot make it flaky.
    @settings(max_examples=300, derandomize=True, database=None, phases=[Phase.generate])
    @given(batches())
    def collect(batch: Any) -> None:
        found.update(features(batch))

    collect()
    assert [f for f in EXPECTED_FEATURES if not found[f]] == []


@given(batches(containers=["namedtuple", "set"], dtypes=[torch.int64], requires_grad=False, aliasing=False))
def test_batches_keep_to_the_options(batch: Any) -> None:
    found = features(batch)
    assert not found & ({*tt.KINDS} - {"namedtuple", "set"})
    assert {f for f in found if f.startswith("torch.")} <= {"torch.int64"}
    assert "requires_grad" not in found
    assert "the same tensor twice" not in found and "distinct tensors over the same memory" not in found


@given(tt.tensors(dtypes=[torch.float16, torch.int8], requires_grad=True))
def test_tensors_require_grad_where_they_can(t: torch.Tensor) -> None:
    assert t.dtype in (torch.float16, torch.int8)
    assert t.requires_grad == (t.dtype == torch.float16)


@settings(max_examples=50)
@given(batches())
def test_batches_pickle(batch: Any) -> None:
    again = pickle.loads(pickle.dumps(batch))
    assert type(again) is type(batch)
    # Pickle writes each tensor's storage anew, so tensors tied by memory come back apart, as with
    # torch; and an OrderedDict comes back in its own order, the dict underneath it reordered too.
    lost = {"distinct tensors over the same memory", "OrderedDict reordered"}
    assert features(again) - lost == features(batch) - lost


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: batches(containers=["dict", "tree"]), ValueError, "Unknown container kind 'tree'"),
        (lambda: batches(max_leaves=0), ValueError, "max_leaves of at least 1"),
        (lambda: tt.tensors(dtypes=[]), ValueError, "at least one dtype"),
        (lambda: tt.tensors(dtypes=["float32"]), TypeError, "Expected torch.dtype values"),
        (lambda: compare(recursive_to_device, max_examples=0), ValueError, "max_examples of at least 1"),
    ],
    ids=["unknown-kind", "max-leaves", "no-dtypes", "not-a-dtype", "max-examples"],
)
def test_options_are_checked(make: Callable[[], Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


# ---------------------------------------------------------------- assert_moved(): right moves pass


@given(batches())
def test_move_to_meta_passes(batch: Any) -> None:
    assert_moved(todevice.move(batch, "meta"), batch, "meta")


@settings(max_examples=50)
@given(batches())
def test_move_with_a_cast_passes_values_included(batch: Any) -> None:
    out = todevice.move(batch, "cpu", dtype=torch.complex128)
    assert_moved(out, batch, torch.device("cpu"), dtype=torch.complex128)


def test_the_message_names_the_path_what_was_expected_and_what_came() -> None:
    t = torch.ones(2)
    source = {"x": [1, 2, Pair(t, "label")]}
    result = {"x": [1, 2, Pair(t, "label")]}
    expected = (
        "At ['x'][2].a: expected a tensor on meta, got Tensor of shape (2,), torch.float32, on cpu: it was not moved."
    )
    with pytest.raises(AssertionError, match=f"^{re.escape(expected)}$"):
        assert_moved(result, source, "meta")


# ---------------------------------------------------------------- assert_moved(): each wrong move fails


def _wrong_cases() -> dict[str, tuple[Any, Callable[[Any], Any], str]]:
    """Source, a function giving a wrong result from move()'s right one, and the start of the message."""
    t = torch.arange(6.0).reshape(2, 3)
    tied = t.detach()
    label = "".join(["la", "bel"])  # made at run time: an equal string is another object
    obj = object()  # no value: only the very same object is right
    reordered = collections.OrderedDict([("a", t), ("b", 1)])
    reordered.move_to_end("a")
    grad = torch.ones(2, requires_grad=True)

    def first(out: Any, **change: Any) -> Any:
        return {**out, **change}

    return {
        "unmoved-tensor": ({"x": [t, Pair(t + 1, 2)]}, lambda o: {"x": [o["x"][0], Pair(t + 1, 2)]}, "At ['x'][1].a:"),
        "container-type": ({"x": Pair(t, 1)}, lambda o: {"x": tuple(o["x"])}, "At ['x']: expected the type Pair"),
        "defaultdict-factory": (
            {"d": collections.defaultdict(list, {"k": t})},
            lambda o: {"d": collections.defaultdict(None, o["d"])},
            "At ['d']: expected a defaultdict whose default_factory is <class 'list'>",
        ),
        "aliasing": (
            {"a": t, "b": t},
            lambda o: first(o, b=t.to("meta")),
            "At ['b']: expected the very tensor found at ['a']",
        ),
        "tied-memory": (
            [tied, tied.view(2, 3)],
            lambda o: [o[0], o[1].clone()],
            "At [1]: expected a tensor sharing memory with the one at [0]",
        ),
        "dtype": ({"x": t}, lambda o: {"x": o["x"].double()}, "At ['x']: expected a tensor of torch.float32"),
        "shape": ({"x": t}, lambda o: {"x": o["x"].t()}, "At ['x']: expected a tensor of shape (2, 3)"),
        "requires-grad": ({"g": grad}, lambda o: {"g": o["g"].detach()}, "At ['g']: expected a tensor requiring grad"),
        "autograd-history": (
            {"g": grad},
            lambda o: {"g": o["g"].detach().requires_grad_()},
            "At ['g']: expected a tensor connected to the source's autograd graph",
        ),
        "replaced-leaf": ({"name": label}, lambda o: {"name": "other"}, "At ['name']: expected str 'label', got str"),
        "replaced-object": ({"o": obj}, lambda o: {"o": object()}, "At ['o']: expected the very same object"),
        "ordereddict-order": (
            {"od": reordered},
            lambda o: {"od": collections.OrderedDict(sorted(o["od"].items()))},
            "At ['od']: expected the keys ['b'], ['a'] in this order",
        ),
        "missing-key": ({"a": t, "b": 1}, lambda o: {"a": o["a"]}, "At the top level: expected the keys ['a'], ['b']"),
        "extra-item": ([t], lambda o: [*o, 1], "At the top level: expected 1 items, got 2."),
        "deque-maxlen": (
            collections.deque([t], maxlen=3),
            lambda o: collections.deque(o),
            "At the top level: expected a deque with maxlen=3",
        ),
        "dataclass-init-false-field": (
            tt._record(t, 1, t, None),
            lambda o: Record(o.a, o.b),
            "At .extra: expected a tensor on meta, got NoneType None.",
        ),
        "subclass-attribute": (
            TaggedDict(label, {"k": t}),
            lambda o: TaggedDict("other", o),
            "At .tag: expected str 'label', got str 'other'",
        ),
        "attribute-left-behind": (
            {"r": tt._record(1, 2, None, t)},
            lambda o: {"r": tt._record(1, 2, None, t)},
            "At ['r'].note: expected a tensor on meta, got Tensor of shape (2, 3), torch.float32, on cpu",
        ),
        "userdict-item": (
            collections.UserDict({"k": t}),
            lambda o: collections.UserDict({"k": t}),
            "At .data['k']: expected a tensor on meta",
        ),
        "set-element": ({t, 1}, lambda o: {t, 1}, "At {"),
        "spurious-aliasing": (
            {"a": t, "b": t.clone()},
            lambda o: first(o, b=o["a"]),
            "At ['b']: expected a tensor of its own, got the very tensor found at ['a']",
        ),
        "spurious-shared-memory": (
            {"a": t, "b": t + 1},
            lambda o: first(o, b=o["a"].view(2, 3)),
            "At ['b']: expected a tensor with memory of its own, got one over memory of the tensor at ['a']",
        ),
        "subclass-lost": (
            {"s": t.as_subclass(Sub)},
            lambda o: {"s": o["s"].as_subclass(torch.Tensor)},
            "At ['s']: expected a Sub, as the source is; got Tensor",
        ),
        "packed-batch-structure": (
            {"p": todevice.pack({"x": t, "n": 1})},
            lambda o: {"p": {"x": o["p"]["x"]}},
            "At ['p']: expected the keys ['x'], ['n']",
        ),
        "packed-batch-tensor": (
            {"p": todevice.pack({"x": t})},
            lambda o: {"p": {"x": o["p"]["x"][:1]}},
            "At ['p']['x']: expected a tensor of shape (2, 3)",
        ),
        "in-place": (
            {"x": [t]},
            lambda o: None,  # replaced below: the source itself, moved in place
            "At ['x']: expected a new list, got the source's own",  # what it holds first, then itself
        ),
    }


WRONG = _wrong_cases()


@pytest.mark.parametrize("name", list(WRONG))
def test_each_wrong_move_fails_naming_its_path(name: str) -> None:
    source, wrong, start = WRONG[name]
    right = todevice.move(source, "meta")
    assert_moved(right, source, "meta")  # the case itself is sound: move()'s result passes
    if name == "in-place":
        source = {"x": [source["x"][0]]}
        result = source
        source["x"] = [source["x"][0].to("meta")]
        with pytest.raises(AssertionError, match=f"^{re.escape(start)}"):
            assert_moved(result, source, "meta")
        return
    with pytest.raises(AssertionError, match=f"^{re.escape(start)}"):
        assert_moved(wrong(right), source, "meta")


def test_set_elements_that_look_alike_are_told_apart_by_where_else_they_are() -> None:
    a, b = torch.empty(0), torch.empty(0)  # on meta, their moves look the same
    source = [{a, b}, {a}, a]
    for _ in range(5):  # sets iterate in an order of their own: each run may pair them differently
        assert_moved(todevice.move(source, "meta"), source, "meta")
    right = todevice.move(source, "meta")
    with pytest.raises(AssertionError, match=re.escape("At [1]{0}: expected the very tensor found at [2]")):
        assert_moved([right[0], {torch.empty(0, device="meta")}, right[2]], source, "meta")


def test_values_are_compared_where_they_can_be_read() -> None:
    source = {"x": torch.arange(3.0)}
    assert_moved({"x": torch.arange(3.0, dtype=torch.float64)}, source, "cpu", dtype=torch.float64)
    with pytest.raises(AssertionError, match=re.escape("At ['x']: expected the source's values")):
        assert_moved({"x": torch.arange(3.0, dtype=torch.float64) + 1}, source, "cpu", dtype=torch.float64)


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0)])
def test_a_move_to_cpu_0_passes(device: Any) -> None:
    """CPU tensors report no index: a move to cpu:0 lands on cpu."""
    x = torch.ones(2)
    assert_moved(todevice.move(x, device), x, device)
    assert_moved(todevice.move({"a": x}, device), {"a": x}, device)
    assert_moved(todevice.move({"a": x}, device, dtype=torch.float64), {"a": x}, device, dtype=torch.float64)


def test_a_tensor_already_there_with_nothing_to_cast_comes_back_as_itself() -> None:
    x, n = torch.ones(2), torch.arange(2)
    assert_moved(todevice.move({"a": x, "n": n}, "cpu"), {"a": x, "n": n}, "cpu")
    with pytest.raises(AssertionError, match=re.escape("At ['a']: expected the source's own tensor")):
        assert_moved({"a": x.clone()}, {"a": x}, "cpu")
    with pytest.raises(AssertionError, match=re.escape("At ['n']: expected the source's own tensor")):
        assert_moved({"n": n.clone()}, {"n": n}, "cpu", dtype=torch.float64)  # integers are not cast
    assert_moved({"a": x.double()}, {"a": x}, "cpu", dtype=torch.float64)  # a cast makes a new one
    m = torch.ones(2, device="meta")
    with pytest.raises(AssertionError, match=re.escape("At the top level: expected the source's own tensor")):
        assert_moved(m.clone(), m, "meta")


def test_a_parameter_may_come_back_a_plain_tensor_as_to_gives_it() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    assert type(todevice.move(p, "meta")) is torch.Tensor
    assert_moved(todevice.move({"p": p}, "meta"), {"p": p}, "meta")
    s = {"s": torch.ones(2).as_subclass(Sub)}
    assert_moved(todevice.move(s, "meta"), s, "meta")


def test_tied_sources_may_come_back_as_one_tensor() -> None:
    t = torch.ones(2, 3)
    tied = [t.detach(), t.detach().view(2, 3)]
    out = todevice.move(tied, "meta")
    assert_moved([out[0], out[0]], tied, "meta")
    assert_moved(out, tied, "meta")


def test_skip_keys_items_must_be_the_very_same_objects() -> None:
    b = {"x": torch.ones(2), "lengths": torch.tensor([1]), "more": [{"lengths": [torch.ones(1)]}]}
    assert_moved(todevice.move(b, "meta", skip_keys="lengths"), b, "meta", skip_keys="lengths")
    assert_moved(todevice.move(b, "meta", skip_keys=["lengths", "x"]), b, "meta", skip_keys=("lengths", "x"))
    with pytest.raises(AssertionError, match=re.escape("At ['lengths']: expected the very same object")):
        assert_moved(todevice.move(b, "meta"), b, "meta", skip_keys="lengths")
    with pytest.raises(AssertionError, match=re.escape("At ['lengths']: expected a tensor on meta")):
        assert_moved(todevice.move(b, "meta", skip_keys="lengths"), b, "meta")
    with pytest.raises(TypeError, match="skip_keys"):
        assert_moved(b, b, "meta", skip_keys=[["lengths"]])
    packed = {"p": todevice.pack(b)}  # a packed batch fills skipped items from its own buffer
    assert_moved(todevice.move(packed, "meta", skip_keys="lengths"), packed, "meta", skip_keys="lengths")


# ---------------------------------------------------------------- compare()

# What the hand-written helper gets wrong: everything but tensors, dicts and lists.
HELPER_MISSES = {k for k in tt.KINDS if k not in ("dict", "list")} | {"aliasing"}


@pytest.fixture(scope="module")
def helper_report() -> tt.Report:
    return compare(recursive_to_device)


def test_compare_finds_every_kind_the_hand_written_helper_mishandles(helper_report: tt.Report) -> None:
    assert not helper_report.ok
    assert {m.kind for m in helper_report.mismatches} == HELPER_MISSES
    for m in helper_report.mismatches:
        assert m.message is not None and m.move_message is None, m
        # The example is the batch as it was, and the helper still gets it wrong.
        with pytest.raises(AssertionError):
            assert_moved(recursive_to_device(m.example, "meta"), m.example, "meta")
        assert_moved(todevice.move(m.example, "meta"), m.example, "meta")


def test_compare_shrinks_each_example(helper_report: tt.Report) -> None:
    by_kind = {m.kind: m for m in helper_report.mismatches}
    assert type(by_kind["namedtuple"].example) is Pair
    assert by_kind["aliasing"].example[0] is by_kind["aliasing"].example[1]
    assert len(by_kind["OrderedDict"].example) == 1  # the type alone is wrong: one tensor shows it
    text = str(helper_report)
    assert text.startswith("recursive_to_device differs from todevice.move() on 13 of 16 kinds")
    assert "- namedtuple, for example Pair(" in text
    assert "Handled as todevice.move() does: tensors, dict, list." in text


@pytest.mark.parametrize("kind", tt.KINDS)
def test_compare_finds_nothing_wrong_with_move_itself(kind: str) -> None:
    report = compare(todevice.move, containers=[kind], aliasing=False)
    assert report.ok, report


def test_compare_checks_aliasing_of_move_itself() -> None:
    report = compare(todevice.move, containers=[])
    assert report.kinds == ("tensors", "aliasing")
    assert report.ok, report
    assert str(report).startswith("move handles every kind checked as todevice.move() does")


def test_compare_reports_a_helper_that_changes_its_input() -> None:
    def in_place(data: Any, device: Any) -> Any:
        """Moves the dict's values in place, then hands back a copy: the caller's batch is changed."""
        if isinstance(data, dict):
            for k in data:
                data[k] = in_place(data[k], device)
            return dict(data)
        return data.to(device) if isinstance(data, torch.Tensor) else data

    (m,) = compare(in_place, containers=["dict"], aliasing=False).mismatches
    assert m.kind == "dict"
    assert m.message is not None and "changed its input" in m.message, m
    found: list[torch.Tensor] = [v for v in m.example.values() if isinstance(v, torch.Tensor)]
    assert found and all(t.device.type == "cpu" for t in found)  # the example as it was, not as left


def test_compare_reports_a_helper_that_raises() -> None:
    def no_tuples(data: Any, device: Any) -> Any:
        if isinstance(data, tuple):
            raise TypeError("tuples are not supported")
        return todevice.move(data, device)

    report = compare(no_tuples, containers=["tuple", "list"], aliasing=False)
    (m,) = report.mismatches
    assert (m.kind, m.message) == ("tuple", "raised TypeError: tuples are not supported")
    assert type(m.example) is tuple and len(m.example) == 1  # the kind at the top, holding a tensor
    assert "    no_tuples: raised TypeError: tuples are not supported" in str(report)
    assert "- tuple, for example (tensor(0.),)" in str(report)


def test_compare_reports_where_move_itself_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the helper is right and move() is not, the report says so: the search runs move() too."""
    real_move = todevice.move

    def broken_move(batch: Any, device: Any, /, **options: Any) -> Any:
        if type(batch) is Pair:
            return tuple(real_move(list(batch), device))
        return real_move(batch, device, **options)

    monkeypatch.setattr(todevice, "move", broken_move)
    report = compare(real_move, containers=["namedtuple"], aliasing=False)
    (m,) = report.mismatches
    assert m.message is None and m.move_message is not None
    assert "expected the type Pair" in m.move_message
    assert "todevice.move() (move is right)" in str(report)


def test_compare_gives_the_same_report_every_run() -> None:
    first = compare(recursive_to_device, containers=["namedtuple", "set"], aliasing=False)
    again = compare(recursive_to_device, containers=["namedtuple", "set"], aliasing=False)
    assert str(first) == str(again)


def _detach(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    if type(x) in (list, tuple):
        return type(x)(_detach(v) for v in x)
    return x


def test_compare_pins_each_mismatch_on_its_kind() -> None:
    def bare_tensors_detached(data: Any, device: Any) -> Any:
        """Wrong on bare tensors only: containers are moved by todevice."""
        return data.detach().to(device) if isinstance(data, torch.Tensor) else todevice.move(data, device)

    report = compare(bare_tensors_detached, containers=["dict", "list", "namedtuple"], aliasing=False)
    assert [m.kind for m in report.mismatches] == ["tensors"], report

    def lists_detached(data: Any, device: Any) -> Any:
        """Moves everything right, then detaches the tensors of lists and tuples: found at the default size."""
        return _detach(todevice.move(data, device))

    report = compare(lists_detached, containers=["list", "tuple", "namedtuple", "dict"], aliasing=False)
    assert [m.kind for m in report.mismatches] == ["tensors", "list", "tuple"], report


def test_compare_reports_a_change_in_place_the_same_way_every_run() -> None:
    def writes_values(data: Any, device: Any) -> Any:
        out = todevice.move(data, device)
        if isinstance(data, torch.Tensor) and data.is_floating_point() and data.numel() and not data.requires_grad:
            data.add_(1)
        return out

    first = compare(writes_values, containers=[], aliasing=False)
    (m,) = first.mismatches
    assert m.message == (
        "At the top level: changed its input: the values of the Tensor of shape (), torch.float32, on cpu there "
        "were written in place. A move must leave its input as it was."
    )
    assert str(first) == str(compare(writes_values, containers=[], aliasing=False))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_compare_refuses_a_device_not_here_up_front() -> None:
    calls: list[Any] = []
    with pytest.raises(ValueError, match="cuda"):
        compare(lambda b, d: calls.append(b), device="cuda")
    assert not calls


def test_compare_refuses_a_helper_that_is_not_callable_before_any_search() -> None:
    with pytest.raises(TypeError, match="compare\\(\\) takes your helper"):
        compare("not a function")  # type: ignore[arg-type]


def test_the_module_exports_its_functions_and_keeps_the_sample_classes_importable() -> None:
    import todevice.testing as testing

    assert set(testing.__all__) == {
        "DTYPES", "KINDS", "batches", "tensors", "Mismatch", "Report", "assert_moved", "compare"
    }  # fmt: skip
    assert all(callable(getattr(testing, name)) or name in ("DTYPES", "KINDS") for name in testing.__all__)
    from todevice.testing import FrozenMapping, Pair, Record, TaggedDict  # what a printed example names

    assert Pair._fields == ("a", "b") and issubclass(TaggedDict, dict) and FrozenMapping and Record


def test_a_registered_container_subclass_is_checked_by_its_registered_rule() -> None:
    """torch pytree's rule for a tuple subclass takes precedence over the subclass's own, as in move(): what its
    flatten keeps aside (here, a tensor) stays where it is."""

    class Tagged(tuple):  # type: ignore[type-arg]
        def __new__(cls, a: Any, meta: Any) -> Tagged:
            out = super().__new__(cls, (a,))
            out.meta = meta
            return out

    torch.utils._pytree.register_pytree_node(Tagged, lambda t: ([t[0]], t.meta), lambda ch, meta: Tagged(ch[0], meta))
    source = Tagged(torch.ones(1), torch.ones(2))
    moved = todevice.move(source, "meta")
    assert moved[0].is_meta and moved.meta is source.meta
    assert_moved(moved, source, "meta")


@pytest.mark.parametrize(
    "source",
    [
        {"size": torch.Size([2, 3]), "x": torch.ones(1)},
        {"name": "".join(["la", "bel"]), "n": 10**20, "f": float("nan"), "x": torch.ones(1)},
        [torch.ones(1), (torch.Size([4]), "a")],
    ],
    ids=["torch.Size", "str-int-nan", "tuple-of-atoms"],
)
def test_an_immutable_value_rebuilt_equal_is_right(source: Any) -> None:
    """A helper may rebuild an immutable value (a torch.Size through type(x)(...), a string, a number): an equal value
    of the same type is what a move must keep."""

    def rebuilt(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to("meta")
        if isinstance(x, dict):
            return {k: rebuilt(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(rebuilt(v) for v in x)
        if isinstance(x, str):
            return "".join(list(x))
        return float(str(x)) if isinstance(x, float) else x

    assert_moved(rebuilt(source), source, "meta")


def test_an_immutable_value_that_differs_is_named() -> None:
    source = {"size": torch.Size([2, 3]), "x": torch.ones(1)}
    with pytest.raises(AssertionError, match=r"At \['size'\]: expected Size torch\.Size\(\[2, 3\]\), got Size"):
        assert_moved({"size": torch.Size([2, 4]), "x": torch.ones(1, device="meta")}, source, "meta")
    with pytest.raises(AssertionError, match=r"At \['size'\]: expected Size .*, got tuple \(2, 3\)"):
        assert_moved({"size": (2, 3), "x": torch.ones(1, device="meta")}, source, "meta")


def test_a_helper_that_skips_a_container_is_told_the_tensor_it_left_behind() -> None:
    """Before the container's identity: the tensor inside it that was not moved, at its path."""
    source = {"r": Record(torch.ones(2), [torch.zeros(1)])}
    with pytest.raises(AssertionError, match=r"At \['r'\]\.a: expected a tensor on meta, .*it was not moved"):
        assert_moved({"r": source["r"]}, source, "meta")


def test_compare_passes_a_correct_hand_written_helper_on_every_kind_it_handles() -> None:
    """Dicts, lists and tuples (a torch.Size among the values rebuilt by type(x)(...)), and bare tensors."""

    def to_device(data: Any, device: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return data.to(device)
        if isinstance(data, dict):
            return {k: to_device(v, device) for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return type(data)(to_device(v, device) for v in data)
        return data

    report = compare(to_device, containers=["dict", "list", "tuple"], aliasing=False)
    assert report.ok, report
