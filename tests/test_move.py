"""move(): properties against the reference, and one explicit case per rule it promises."""

from __future__ import annotations

import collections
import copy
import dataclasses
import sys
import warnings
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.nn.utils.rnn import pack_padded_sequence

import todevice
from tests import helpers, strategies
from todevice import _into, _layout, _move, _stream


def moved(tree: Any, device: torch.device, dtype: torch.dtype | None = None, coalesce: bool = False) -> Any:
    """move()'s walk, and the state it left (its memo, its outputs)."""
    p = _move.plan_for(device, True, dtype)
    state = _move.State(p, None, coalesce)
    out = _move._batch(tree, state)
    return out, state


META = torch.device("meta")
CPU = torch.device("cpu")
CORPUS = helpers.corpus()

# Casting complex tensors to a real dtype warns in torch (and in nn.Module.to), by design: the
# random trees hold complex tensors and the dtype tests cast them.
pytestmark = pytest.mark.filterwarnings("ignore:Casting complex values to real discards:UserWarning")


# ---------------------------------------------------------------- properties


@given(strategies.trees)
def test_meta_matches_reference(tree: Any) -> None:
    helpers.assert_same_tree(todevice.move(tree, "meta"), helpers.reference_move(tree, "meta"))


@given(strategies.trees)
def test_cpu_keeps_every_value(tree: Any) -> None:
    helpers.assert_same_tree(todevice.move(tree, "cpu"), helpers.reference_move(tree, "cpu"), values=True)


@given(strategies.trees, strategies.st.sampled_from([torch.float64, torch.float16, torch.complex128]))
def test_dtype_cast_matches_reference(tree: Any, st_dtype: torch.dtype) -> None:
    actual = todevice.move(tree, "cpu", dtype=st_dtype)
    expected = helpers.reference_move(tree, "cpu", st_dtype)
    helpers.assert_same_tree(actual, expected, values=True)


@given(strategies.trees, strategies.st.sampled_from(["meta", "cpu"]))
def test_input_is_never_mutated(tree: Any, device: str) -> None:
    before = helpers.snapshot(tree)
    todevice.move(tree, device, dtype=torch.float64)
    todevice.move(tree, device)
    helpers.assert_snapshot_equal(before, helpers.snapshot(tree))


@given(strategies.trees_with_aliases())
def test_aliases_and_shared_memory_survive(tree: Any) -> None:
    out = todevice.move(tree, "cpu", dtype=torch.float64)
    a, b = out["aliases"]
    assert a is b
    t1, t2 = out["tied"]
    if t1.numel() and (t1.is_floating_point() or t1.is_complex()):
        assert t1 is not t2
        assert t1.data_ptr() == t2.data_ptr()


@settings(max_examples=max(1, settings().max_examples // 2))  # each example packs and moves several batches
@given(
    strategies.shared_trees(),
    st.sampled_from([None, "a"]),
    st.sampled_from([None, True, False]),
    st.sampled_from(["meta", "cpu"]),
)
def test_every_kind_skips_its_keys_and_keeps_a_repeated_tensor_one(
    tree: Any, skip: str | None, coalesce: bool | None, device: str
) -> None:
    """List subclasses with attributes, pytree-registered mappings, mappings with their own .to() and packed batches,
    sharing tensors with the rest of the batch: the reference's items, the same tensors shared, the input unchanged."""
    before = helpers.snapshot(tree)
    out = todevice.move(tree, device, skip_keys=skip, coalesce=coalesce)
    expected = helpers.reference_move(tree, device, skip=frozenset() if skip is None else frozenset({skip}))
    helpers.assert_same_tree(out, expected, values=device == "cpu")
    assert helpers.sharing(out) == helpers.sharing(expected)
    helpers.assert_snapshot_equal(before, helpers.snapshot(tree))


@given(strategies.trees)
def test_deep_fallback_walk_matches_the_recursive_walk(tree: Any) -> None:
    """The stack-based walk used past Python's recursion limit agrees with the fast walk."""
    p = _move.plan_for(META, True, None)
    helpers.assert_same_tree(p.memo_walk.walk_iteratively(tree, _move.State(p)), todevice.move(tree, "meta"))


# ---------------------------------------------------------------- the corpus, case by case


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_matches_reference(name: str) -> None:
    tree = CORPUS[name]
    before = helpers.snapshot(tree)
    with helpers.left_behind(name):
        helpers.assert_same_tree(todevice.move(tree, "meta"), helpers.reference_move(tree, "meta"))
    helpers.assert_snapshot_equal(before, helpers.snapshot(tree))


# ---------------------------------------------------------------- tensors


def test_tensor_already_there_is_the_same_object() -> None:
    t = torch.ones(2)
    assert todevice.move(t, "cpu") is t
    assert todevice.move({"t": t}, "cpu")["t"] is t
    assert todevice.move([t], CPU, dtype=torch.float32)[0] is t


def test_tensor_leaf_is_what_to_gives() -> None:
    t = torch.ones(2, 3, requires_grad=True)
    out = todevice.move(t, "meta")
    ref = t.to("meta")
    assert (out.device, out.dtype, out.shape, out.requires_grad) == (ref.device, ref.dtype, ref.shape, True)
    assert type(out.grad_fn) is type(ref.grad_fn)


def test_parameter_leaf() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    assert todevice.move(p, "cpu") is p
    out = todevice.move({"p": p}, "meta")["p"]
    assert out.device == META and out.requires_grad


def test_gradients_flow_back_through_a_move() -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    out = todevice.move({"x": [x]}, "cpu", dtype=torch.float64)
    (out["x"][0] * 3).sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.full((2,), 3.0))


def test_dtype_casts_only_floating_and_complex() -> None:
    tree = {"f": torch.ones(2), "i": torch.arange(2), "b": torch.ones(2, dtype=torch.bool), "h": torch.ones(1).half()}
    out = todevice.move(tree, "cpu", dtype=torch.float64)
    assert out["f"].dtype == torch.float64 and out["h"].dtype == torch.float64
    assert out["i"] is tree["i"] and out["b"] is tree["b"]


@pytest.mark.parametrize("bad", [torch.int64, torch.bool])
def test_dtype_must_be_floating_or_complex(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"move\(\) casts floating-point and complex tensors only"):
        todevice.move(torch.ones(1), "cpu", dtype=bad)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("float16", "got str. Pass torch.float16."),
        ("fp16", "got str. Pass a floating-point one"),
        ("int64", "got str. Pass a floating-point one"),  # a dtype move() does not cast to: not suggested
        (16, "got int"),
    ],
)
def test_a_dtype_that_is_no_torch_dtype_is_named_with_what_to_pass(bad: Any, says: str) -> None:
    with pytest.raises(TypeError, match=rf"Cannot cast to dtype={bad!r}: expected a torch\.dtype, {says}"):
        todevice.move(torch.ones(1), "cpu", dtype=bad)


def test_sparse_tensor_moves() -> None:
    s = torch.eye(3).to_sparse()
    out = todevice.move({"s": s}, "meta")["s"]
    assert out.is_sparse and out.device == META


# ---------------------------------------------------------------- containers


def test_defaultdict_keeps_its_factory() -> None:
    d = collections.defaultdict(list, {"a": torch.ones(1)})
    out = todevice.move(d, "meta")
    assert type(out) is collections.defaultdict and out.default_factory is list
    out["new"].append(1)
    assert "new" not in d


def test_ordered_dict_keeps_order_and_type() -> None:
    d = collections.OrderedDict([("z", torch.ones(1)), ("a", torch.ones(1))])
    out = todevice.move(d, "meta")
    assert type(out) is collections.OrderedDict and list(out) == ["z", "a"]


def test_dict_keeps_insertion_order() -> None:
    d = {"z": 1, "a": torch.ones(1), "m": 2}
    assert list(todevice.move(d, "meta")) == ["z", "a", "m"]


def test_deque_keeps_maxlen() -> None:
    out = todevice.move(collections.deque([torch.ones(1)], maxlen=3), "meta")
    assert type(out) is collections.deque and out.maxlen == 3 and out[0].device == META


def test_sets_move_their_tensors() -> None:
    t = torch.ones(1)
    out = todevice.move({"s": {t, 1}, "f": frozenset({t})}, "meta")
    assert type(out["s"]) is set and type(out["f"]) is frozenset
    assert {x.device for x in out["s"] if isinstance(x, torch.Tensor)} == {META}
    assert 1 in out["s"]
    assert next(iter(out["f"])) is next(x for x in out["s"] if isinstance(x, torch.Tensor))


def test_none_anywhere() -> None:
    assert todevice.move(None, "meta") is None
    assert todevice.move([None, {"a": None}], "meta") == [None, {"a": None}]


def test_namedtuple_keeps_type() -> None:
    out = todevice.move(helpers.Point(torch.ones(1), "y"), "meta")
    assert type(out) is helpers.Point and out.x.device == META and out.y == "y"


def test_structseq_keeps_type() -> None:
    result = torch.max(torch.ones(2, 2), 0)
    out = todevice.move(result, "meta")
    assert type(out) is type(result) and out.values.device == META and out.indices.device == META


@pytest.mark.parametrize("cls", helpers.DATACLASSES)
def test_dataclass_keeps_type_and_moves_fields(cls: type) -> None:
    obj = cls(torch.ones(1), [torch.zeros(1)])
    out = todevice.move(obj, "meta")
    assert type(out) is cls
    assert out.a.device == META and out.b[0].device == META
    assert obj.a.device == CPU


def test_dataclass_init_false_field_is_moved() -> None:
    obj = helpers.make_late(torch.ones(1), torch.zeros(1))
    out = todevice.move(obj, "meta")
    assert out.late.device == META and out.a.device == META
    assert obj.late.device == CPU


def test_dataclass_without_a_value_for_an_init_false_field() -> None:
    @dataclasses.dataclass
    class Partial:
        a: Any
        b: Any = dataclasses.field(init=False)

    out = todevice.move(Partial(torch.ones(1)), "meta")
    assert out.a.device == META and not hasattr(out, "b")


def test_dataclass_extra_attributes_are_kept() -> None:
    obj = helpers.Record(torch.ones(1))
    obj.note = "kept"  # type: ignore[attr-defined]
    out = todevice.move(obj, "meta")
    assert out.note == "kept"


def test_dict_subclass_keeps_type_and_state_without_calling_init() -> None:
    d = helpers.TaggedDict("train", {"x": torch.ones(1)})
    out = todevice.move(d, "meta")
    assert type(out) is helpers.TaggedDict and out.tag == "train" and out["x"].device == META
    assert d["x"].device == CPU


def test_list_subclass_keeps_type_and_state() -> None:
    lst = helpers.TaggedList("val", [torch.ones(1), 2])
    out = todevice.move(lst, "meta")
    assert type(out) is helpers.TaggedList and out.tag == "val" and out[0].device == META and out[1] == 2


def _subclasses(t: torch.Tensor) -> dict[str, Any]:
    """A tuple (not a namedtuple), deque, set and frozenset subclass, each with an attribute (a tensor in two)."""
    return {
        "tuple": helpers.TaggedTuple(t, [t, 1, torch.zeros(2)]),
        "deque": helpers.TaggedDeque("tag", [t, 2], maxlen=5),
        "set": helpers.TaggedSet(torch.ones(3), [t, 3]),
        "frozenset": helpers.TaggedFrozenset("tag", [t, 4]),
    }


@pytest.mark.parametrize("how", ["walk", "coalesced", "packed", "compiled", "out="])
def test_tuple_deque_set_and_frozenset_subclasses_are_moved_type_attributes_and_items_kept(how: str) -> None:
    """As list subclasses are: no constructor of theirs runs (these want a tag first), a deque keeps its maxlen, and a
    tensor in an attribute and an item is one tensor. out= pairs a tuple's and a deque's items, and refuses a set's,
    which have no order."""
    t = torch.arange(3.0)
    batch = _subclasses(t)
    if how == "out=":
        ordered = {k: v for k, v in batch.items() if k in ("tuple", "deque")}
        static = todevice.move(ordered, "cpu", dtype=torch.float64)  # new tensors, the very structure
        static = todevice.move(static, "cpu", dtype=torch.float32)
        assert todevice.move(ordered, out=static) is static
        assert torch.equal(static["tuple"][0], t) and torch.equal(static["tuple"].tag, t)
        assert static["tuple"][0] is static["tuple"].tag and torch.equal(static["deque"][0], t)
        for kind in ("set", "frozenset"):
            with pytest.raises(ValueError, match=rf"at \['{kind}'\], the batch holds a set"):
                todevice.move({kind: batch[kind]}, out=todevice.move({kind: batch[kind]}, "meta"))
        return
    if how == "compiled":
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dynamo's own, where it breaks the graph at a subclass
            out = torch.compile(lambda b: todevice.move(b, "meta"), backend="eager")(batch)
    else:
        obj = todevice.pack(batch) if how == "packed" else batch
        out = todevice.move(obj, "meta", coalesce=how == "coalesced")
    helpers.assert_same_tree(out, helpers.reference_move(batch, "meta"), same=how != "compiled")
    assert out["tuple"][0] is out["tuple"].tag is out["deque"][0] and out["tuple"][0].is_meta
    assert out["deque"].maxlen == 5 and out["deque"].tag == "tag" and out["set"].tag.is_meta
    assert {v.device.type for v in out["set"] if isinstance(v, torch.Tensor)} == {"meta"}
    assert all(type(out[k]) is type(batch[k]) for k in batch)
    assert batch["tuple"][0] is t and t.device == CPU  # nothing changed in place


@pytest.mark.parametrize("kind", helpers.TAGGED_SEQUENCES, ids=lambda c: c.__name__)
def test_each_subclass_alone_under_torch_compile_gives_the_eager_result(kind: type) -> None:
    """Where dynamo cannot make one (a set or frozenset subclass: its base's __new__), the graph breaks there."""
    t = torch.ones(2)
    batch = [kind("tag", [t]), torch.zeros(1)]
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's own
        out = torch.compile(lambda b: todevice.move(b, "meta"), backend="eager")(batch)
    assert type(out[0]) is kind and [v.device for v in out[0]] == [META] and out[1].device == META


def test_ordered_dict_and_defaultdict_subclasses() -> None:
    class MyOrdered(collections.OrderedDict):  # type: ignore[type-arg]
        pass

    class MyDefault(collections.defaultdict):  # type: ignore[type-arg]
        pass

    o = MyOrdered([("b", torch.ones(1)), ("a", 2)])
    out = todevice.move(o, "meta")
    assert type(out) is MyOrdered and list(out) == ["b", "a"] and out["b"].device == META
    o.move_to_end("b")  # the copy has its own order bookkeeping
    assert list(out) == ["b", "a"]
    d = MyDefault(list, {"x": torch.ones(1)})
    out_d = todevice.move(d, "meta")
    assert type(out_d) is MyDefault and out_d.default_factory is list and out_d["x"].device == META


def test_dataclass_that_is_also_a_dict() -> None:
    """Like transformers' ModelOutput: fields and items both move, to the same tensors."""

    @dataclasses.dataclass
    class Output(collections.OrderedDict):  # type: ignore[type-arg]
        logits: Any = None

        def __post_init__(self) -> None:
            self["logits"] = self.logits

    out = todevice.move(Output(torch.ones(2)), "meta")
    assert type(out) is Output and out.logits.device == META and out["logits"] is out.logits


def test_a_container_reached_twice_is_rebuilt_twice_around_the_same_tensors() -> None:
    inner = [torch.ones(1)]
    out = todevice.move({"a": inner, "b": inner}, "meta")
    assert out["a"] is not inner and out["b"] is not inner
    assert out["a"][0] is out["b"][0]


# ---------------------------------------------------------------- objects with .to()


class Moves:
    """An object with .to() that takes non_blocking and moves in place, as BatchEncoding does."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.calls: list[dict[str, Any]] = []

    def to(self, device: Any, non_blocking: bool = False) -> Moves:
        # Rebinds its attributes in place, as BatchEncoding.to() and PyG's Data.to() do.
        self.calls = [*self.calls, {"device": device, "non_blocking": non_blocking}]
        self.t = self.t.to(device, non_blocking=non_blocking)
        return self


class MovesPlainly:
    """An object whose .to() takes only a device."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: Any) -> MovesPlainly:
        return MovesPlainly(self.t.to(device))


class MovesWithKwargs:
    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    def to(self, *args: Any, **kwargs: Any) -> MovesWithKwargs:
        out = MovesWithKwargs()
        out.kwargs = kwargs
        return out


def test_to_object_uses_its_own_to_with_non_blocking() -> None:
    obj = Moves(torch.ones(1))
    out = todevice.move({"o": obj}, "meta", non_blocking=False)["o"]
    assert out.t.device == META
    assert out.calls[-1] == {"device": META, "non_blocking": False}


def test_to_object_that_moves_in_place_leaves_the_input_alone() -> None:
    obj = Moves(torch.ones(1))
    out = todevice.move(obj, "meta")
    assert out is not obj and out.t.device == META
    assert obj.t.device == CPU and obj.calls == []


def test_to_object_without_non_blocking() -> None:
    out = todevice.move([MovesPlainly(torch.ones(1))], "meta")[0]
    assert out.t.device == META


def test_to_object_with_kwargs_gets_non_blocking() -> None:
    out = todevice.move(MovesWithKwargs(), "meta", non_blocking=True)
    assert out.kwargs == {"non_blocking": True}


def test_packed_sequence_uses_its_own_to() -> None:
    """PackedSequence is a namedtuple, but its .to() keeps batch_sizes on the CPU, as RNNs need."""
    seq = pack_padded_sequence(torch.ones(3, 2, 4), torch.tensor([3, 2]))
    out = todevice.move({"seq": seq}, "meta")["seq"]
    assert type(out) is type(seq)
    assert out.data.device == META
    assert out.batch_sizes.device == CPU


def test_module_is_left_as_it_is_with_a_warning_naming_its_path_and_the_fix() -> None:
    m = torch.nn.Linear(2, 2)
    said = r"passed the nn.Module torch.nn.modules.linear.Linear at \['m'\] through as it is: its .to\(\) moves it in"
    for coalesce in (None, True, False):
        with pytest.warns(todevice.errors.TensorsLeftBehindWarning, match=said + r".*Move it with module.to\(device\)"):
            out = todevice.move({"m": m, "x": torch.ones(1)}, "meta", coalesce=coalesce)
        assert out["m"] is m and m.weight.device == CPU
    with pytest.raises(TypeError, match=r"\['m'\]: Linear \(an nn.Module: move it with module.to\(device\)\)"):
        todevice.move({"m": m}, "meta", strict=True)


@pytest.mark.parametrize(
    "make",
    [lambda t: (v for v in [t]), lambda t: iter([t]), lambda t: map(lambda v: v, [t])],
    ids=["gen", "iter", "map"],
)
def test_an_iterator_is_passed_through_with_a_warning_naming_its_path(make: Any) -> None:
    """Walking it would use it up: it comes back as it is, and the warning says to pass a list."""
    it = make(torch.ones(1))
    for how in ({}, {"coalesce": True}, {"dtype": torch.float64}):
        with pytest.warns(todevice.errors.TensorsLeftBehindWarning, match=r"at \['b'\]\[1\] through as it is: walking"):
            out = todevice.move({"b": [torch.ones(1), it]}, "meta", **how)
        assert out["b"][1] is it
    assert next(it).device == CPU  # not used up
    with pytest.raises(TypeError, match=r"an iterator, which a walk would use up: pass a list or a tuple"):
        todevice.move({"b": it}, "meta", strict=True)


# ---------------------------------------------------------------- precedence


def test_registered_type_beats_to_duck_typing() -> None:
    class Both:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def to(self, device: Any) -> Both:
            raise AssertionError("the registration should win")

    todevice.register(Both, lambda b: ([b.t], None), lambda aux, ch: Both(ch[0]))
    try:
        assert todevice.move(Both(torch.ones(1)), "meta").t.device == META
    finally:
        todevice.unregister(Both)


def test_registered_namedtuple_beats_builtin_rule() -> None:
    seen: list[Any] = []

    def flatten(p: helpers.Point) -> tuple[list[Any], None]:
        seen.append(p)
        return [p.x], None

    todevice.register(helpers.Point, flatten, lambda aux, ch: helpers.Point(ch[0], "registered"))
    try:
        out = todevice.move(helpers.Point(torch.ones(1), "y"), "meta")
        assert out.y == "registered" and seen
    finally:
        todevice.unregister(helpers.Point)
    assert todevice.move(helpers.Point(1, "y"), "meta").y == "y"


def test_to_beats_dataclass() -> None:
    @dataclasses.dataclass
    class WithTo:
        t: Any

        def to(self, device: Any) -> str:
            return "moved by to"

    assert todevice.move(WithTo(torch.ones(1)), "meta") == "moved by to"


def test_dict_subclass_with_to_uses_to() -> None:
    class Encoding(dict):  # type: ignore[type-arg]
        def to(self, device: Any) -> str:
            return "moved by to"

    assert todevice.move(Encoding(a=torch.ones(1)), "meta") == "moved by to"


# ---------------------------------------------------------------- aliasing and tied weights


def test_same_tensor_twice_is_moved_once() -> None:
    t = torch.ones(2)
    out = todevice.move({"a": t, "b": [t], "c": (t,)}, "meta")
    assert out["a"] is out["b"][0] is out["c"][0]


def test_tied_weights_in_a_state_dict_keep_sharing_memory() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(4, 3)
            self.head = torch.nn.Linear(3, 4, bias=False)
            self.head.weight = self.embed.weight

    sd = Tied().state_dict()
    assert sd["embed.weight"] is not sd["head.weight"]
    out = todevice.move(sd, "cpu", dtype=torch.float64)
    assert out["embed.weight"].data_ptr() == out["head.weight"].data_ptr()
    out["embed.weight"][0, 0] = 42.0
    assert out["head.weight"][0, 0] == 42.0
    assert sd["head.weight"][0, 0] != 42.0


def test_views_of_different_parts_do_not_share() -> None:
    base = torch.arange(4.0)
    out = todevice.move([base[:2], base[2:]], "cpu", dtype=torch.float64)
    assert torch.equal(out[0], torch.tensor([0.0, 1.0])) and torch.equal(out[1], torch.tensor([2.0, 3.0]))


def test_distinct_tensors_requiring_grad_are_moved_separately() -> None:
    """Sharing memory would route one tensor's gradient through the other."""
    base = torch.ones(2)
    a = base.requires_grad_(True)
    b = a.view(2)  # a non-leaf over the same memory
    out = todevice.move([a, b], "cpu", dtype=torch.float64)
    (out[0].sum() + 2 * out[1].sum()).backward()
    assert a.grad is not None
    assert torch.equal(a.grad, torch.full((2,), 3.0))


def test_same_geometry_different_dtype_does_not_share() -> None:
    base = torch.zeros(4, dtype=torch.int32)
    as_float = base.view(torch.float32)
    out = todevice.move([base, as_float], "meta")
    assert out[0].dtype == torch.int32 and out[1].dtype == torch.float32


# ---------------------------------------------------------------- non-blocking and the device-to-host wait


def test_device_to_host_waits_before_returning(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non_blocking copy into host memory is synchronized once per source device before return."""
    synced: list[torch.device] = []
    monkeypatch.setattr(_stream, "synchronize", synced.append)

    class OnAGpu:
        device = torch.device("cuda", 0)
        is_cpu = is_meta = False

    _stream.wait_for([OnAGpu(), OnAGpu(), torch.ones(1)])  # type: ignore[list-item]  # what copies from cuda:0 leave
    assert synced == [OnAGpu.device]


def test_moves_to_the_host_wait_on_every_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way a move to the host can go ends in one wait for the copies' source devices."""
    waited: list[Any] = []
    monkeypatch.setattr(_stream, "wait_for", lambda sources, also=None: waited.append(list(sources)))
    t, u = torch.ones(2), torch.zeros(3)
    packed = todevice.pack({"p": torch.ones(1)})
    paths = {
        "one walk": {"t": t, "u": u},
        "a tensor met twice": {"t": t, "again": [t]},
        "an object with .to()": {"t": t, "seq": pack_padded_sequence(torch.ones(2, 1), [2])},
        "a packed batch": {"t": t, "packed": packed},
    }
    for name, tree in paths.items():
        waited.clear()
        todevice.move(tree, "cpu", dtype=torch.float64)
        assert len(waited) == 1, name
        assert any(s is t for s in waited[0]), name
    waited.clear()
    packed.unpack()
    assert len(waited) == 1, "unpack"


def test_host_copies_do_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(_stream, "synchronize", synced.append)
    todevice.move({"x": torch.ones(2)}, "cpu", dtype=torch.float64)
    assert synced == []


def test_blocking_moves_to_the_host_never_wait() -> None:
    assert not _move.plan_for(CPU, False, None).to_host


# ---------------------------------------------------------------- deep and cyclic structures


def test_cyclic_list_raises() -> None:
    cyc: list[Any] = [torch.ones(1)]
    cyc.append(cyc)
    with pytest.raises(
        ValueError, match=r"Cannot move a cyclic structure: the list at the top level contains itself at \[1\]"
    ):
        todevice.move(cyc, "meta")


def test_cycle_deep_inside_names_its_path() -> None:
    inner: dict[str, Any] = {}
    inner["self"] = [inner]
    with pytest.raises(ValueError, match=r"the dict at \['a'\] contains itself at \['a'\]\['self'\]\[0\]"):
        todevice.move({"a": inner}, "meta")


def test_cyclic_dataclass_raises() -> None:
    r = helpers.Record(torch.ones(1))
    r.b = [r]
    with pytest.raises(ValueError, match="cyclic"):
        todevice.move(r, "meta")


def test_ten_thousand_levels_work() -> None:
    root: list[Any] = []
    node = root
    for _ in range(10_000):
        child: list[Any] = [torch.ones(1)]
        node.append(child)
        node = child
    out = todevice.move(root, "meta")
    depth = 0
    node = out[0]
    while len(node) == 2:  # [tensor, child], down to the innermost [tensor]
        assert type(node) is list and node[0].device == META
        node = node[1]
        depth += 1
    assert node[0].device == META
    assert depth == 10_000 - 1


def test_deep_and_shared_still_moves_each_tensor_once() -> None:
    t = torch.ones(1)
    root: list[Any] = []
    node = root
    for _ in range(3000):
        child: list[Any] = [t]
        node.append(child)
        node = child
    out = todevice.move(root, "meta")
    seen = set()
    node = out
    while node:
        if len(node) == 2 or isinstance(node[0], torch.Tensor):
            seen.add(id(node[0]))
        node = node[-1] if isinstance(node[-1], list) else []
    assert len(seen) == 1


# ---------------------------------------------------------------- errors


def test_failed_leaf_names_its_path() -> None:
    tree = {"x": [torch.ones(1), torch.empty(2, device="meta")]}
    with pytest.raises(
        NotImplementedError,
        match=r"Cannot move \['x'\]\[1\] \(Tensor of shape \(2,\), torch.float32, on meta\) to cpu: ",
    ):
        todevice.move(tree, "cpu")


def test_failed_leaf_in_a_dataclass_field() -> None:
    tree = {"x": [0, 1, helpers.Record(torch.empty(1, device="meta"))]}
    with pytest.raises(NotImplementedError, match=r"Cannot move \['x'\]\[2\]\.a "):
        todevice.move(tree, "cpu")


def test_failed_to_object_names_its_path() -> None:
    class Broken:
        def to(self, device: Any) -> Any:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match=r"Cannot move \['k'\] \(.*Broken\) to meta: boom"):
        todevice.move({"k": Broken()}, "meta")


def test_strict_lists_every_unknown_leaf_with_its_path() -> None:
    class Opaque:
        pass

    tree = {"x": [1, 2, helpers.Record(Opaque())], "m": torch.nn.Linear(1, 1), "ok": torch.ones(1)}
    with pytest.raises(TypeError) as info:
        todevice.move(tree, "meta", strict=True)
    msg = str(info.value)
    assert msg.startswith("Cannot move 2 object(s) with strict=True")
    assert "  ['x'][2].a: test_strict_lists_every_unknown_leaf_with_its_path.<locals>.Opaque\n" in msg
    assert "  ['m']: Linear (an nn.Module: move it with module.to(device))\n" in msg
    assert msg.endswith(
        "Register their types with todevice.register(), or pass strict=False to leave them as they are."
    )


def test_strict_accepts_every_atomic_value() -> None:
    np = pytest.importorskip("numpy")

    tree = [*CORPUS["atoms"], np.float32(1.0), np.int64(2), torch.Size([1]), helpers.Color.BLUE]
    out = todevice.move(tree, "meta", strict=True)
    assert all(a is b for a, b in zip(out, tree))


def test_without_strict_unknown_objects_pass_through() -> None:
    obj = object()
    assert todevice.move({"o": obj}, "meta")["o"] is obj


def test_strict_caps_long_lists() -> None:
    with pytest.raises(TypeError, match=r"\.\.\. and 10 more"):
        todevice.move([object() for _ in range(30)], "meta", strict=True)


# ---------------------------------------------------------------- devices


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "not a device"])
def test_invalid_device_string(device: str) -> None:
    with pytest.raises(ValueError, match=f"Cannot move to device '{device}': PyTorch does not know this device string"):
        todevice.move(torch.ones(1), device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device() -> None:
    with pytest.raises(
        ValueError, match=r"Cannot move to device 'cuda:1': cuda is not available on this machine\. Devices here: cpu"
    ):
        todevice.move(torch.ones(1), "cuda:1")


@pytest.mark.skipif(_stream.accelerator() is not None, reason="needs a machine without an accelerator")
def test_integer_device_without_accelerator() -> None:
    with pytest.raises(ValueError, match="an integer names an accelerator, and this machine has none"):
        todevice.move(torch.ones(1), 0)


def test_before_torch_2_8_the_accelerator_is_asked_through_its_own_module(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []

    class FakeCuda:  # what _stream asks of torch.cuda where torch.accelerator lacks device_index
        __name__ = "torch.cuda"
        is_available = staticmethod(lambda: True)
        device_count = staticmethod(lambda: 2)
        current_device = staticmethod(lambda: 1)
        set_device = staticmethod(lambda i: calls.append(("set_device", i)))
        device = staticmethod(lambda i: ("device", i))
        current_stream = staticmethod(lambda d=None: Stream(d))
        set_stream = staticmethod(lambda st: calls.append(("set_stream", st)))

    class Stream:
        def __init__(self, device: Any) -> None:
            self.device = device

        def synchronize(self) -> None:
            calls.append(("synchronize", self.device))

    backend = _stream._Backend()
    monkeypatch.setattr(_stream, "accel", backend)
    monkeypatch.setattr(torch, "cuda", FakeCuda())
    assert _stream.accelerator() == torch.device("cuda")
    assert _stream.available_devices() == ["cpu", "cuda:0", "cuda:1", "meta"]
    assert _stream.current_index() == 1
    _stream.set_index(0)
    assert _stream.on_device(torch.device("cuda", 0)) == ("device", 0)
    backend.set_stream("s")
    _stream.synchronize(torch.device("cuda", 1))
    assert calls == [("set_device", 0), ("set_stream", "s"), ("synchronize", torch.device("cuda", 1))]


def test_before_torch_2_8_a_host_only_machine_has_no_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stream, "accel", _stream._Backend())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _stream.accelerator() is None
    assert todevice.move({"x": torch.ones(2)}, "cpu")["x"].device == torch.device("cpu")
    with pytest.raises(ValueError, match="an integer names an accelerator, and this machine has none"):
        todevice.move(torch.ones(1), 0)


def test_the_accelerator_is_asked_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking costs a call into the backend (and NVML, where Lightning set PYTORCH_NVML_BASED_CUDA_CHECK=1), so the
    answer is kept for the process; a forked process asks again."""
    asked: list[int] = []

    class Counted(_stream._Backend):
        def is_available(self) -> bool:
            asked.append(1)
            return False

    monkeypatch.setattr(_stream, "accel", Counted())
    static = {"x": torch.zeros(2)}
    for _ in range(3):
        todevice.move({"x": torch.ones(2)}, "cpu", dtype=torch.float64)
        todevice.move({"x": torch.ones(2)}, out=static)
        assert _stream.accelerator() is None and not _stream.is_accelerator(torch.device("cpu"))
    assert asked == [1]
    monkeypatch.setattr(_stream.os, "getpid", lambda: -1)  # another process's question
    assert _stream.accelerator() is None and asked == [1, 1]


def test_negative_device_index() -> None:
    with pytest.raises(ValueError, match="a device index cannot be negative"):
        todevice.move(torch.ones(1), -1)


@pytest.mark.parametrize("device", [True, 1.0, ["cpu"]])
def test_device_of_the_wrong_type(device: Any) -> None:
    with pytest.raises(TypeError, match=r"expected a str, an int or a torch\.device"):
        todevice.move(torch.ones(1), device)


def test_no_device_is_named_as_such_and_where_it_may_be_left_out() -> None:
    """The signature reads device=None: move() takes None only with out=, and says so."""
    with pytest.raises(TypeError, match=r"device None: name the device, .* leaves it out only with out="):
        todevice.move({"x": torch.ones(1)})
    assert todevice.move({"x": torch.ones(1)}, out={"x": torch.zeros(1)})["x"].item() == 1


def test_invalid_device_is_caught_before_anything_is_copied() -> None:
    obj = Moves(torch.ones(1))
    with pytest.raises(ValueError):
        todevice.move({"o": obj, "t": torch.ones(1)}, "gpu")
    assert obj.calls == []


@pytest.mark.parametrize("device", ["cpu", "meta", torch.device("cpu"), torch.device("meta"), "cpu:0"])
def test_valid_device_forms(device: Any) -> None:
    assert todevice.move(torch.ones(1), device).device.type == torch.device(device).type


def _every_path(batch: Any, device: Any, **options: Any) -> dict[str, Any]:
    """``batch`` moved to ``device`` each way a move goes (out=, into targets that move() made there)."""

    def compiled() -> Any:
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dynamo's own
            return torch.compile(lambda b: todevice.move(b, device, **options), backend="eager")(batch)

    return {
        "walk": todevice.move(batch, device, **options),
        "coalesced": todevice.move(batch, device, coalesce=True, **options),
        "packed": todevice.move(todevice.pack(batch), device, **options),
        "compiled": compiled(),
        "out=": todevice.move(batch, device, out=todevice.move(batch, device, coalesce=True), **options),
    }


@pytest.mark.parametrize("index", ["meta:0", torch.device("meta", 0), "cpu:0"])
def test_a_host_device_named_with_index_0_is_the_device_tensors_report(index: Any) -> None:
    """torch drops the index of cpu:0 and meta:0: so does move(), on every path, and out= takes the targets that
    move() made there."""
    batch = {"x": torch.ones(2), "y": [torch.arange(3), torch.ones(1)]}
    for name, got in _every_path(batch, index).items():
        assert got["x"].device == torch.device(torch.device(index).type), name


def test_a_move_to_the_host_ignores_a_host_stream_on_every_path() -> None:
    """A device-agnostic loop makes its stream with torch.Stream(device=device): on the host there are no streams to
    order, and the move is the one without it (as the compiled move ignores any stream)."""
    stream = torch.Stream(device="cpu")
    batch = {"x": torch.ones(2), "y": [torch.arange(3), torch.ones(1, dtype=torch.float64)]}
    for device in ("cpu", "meta"):
        for got in _every_path(batch, device, stream=stream).values():
            helpers.assert_same_tree(got, helpers.reference_move(batch, device), values=device == "cpu", same=False)
        assert todevice.move(batch["x"], device, stream=stream).device.type == device  # a bare tensor too


# ---------------------------------------------------------------- misc


def test_result_type_is_the_input_type() -> None:
    tree = {"a": [torch.ones(1)]}
    out: dict[str, list[torch.Tensor]] = todevice.move(tree, "meta")
    assert type(out) is dict


def test_copy_module_is_not_used_for_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers are rebuilt, never copied with copy.copy (which may call user hooks)."""
    calls: ClassVar[list[Any]] = []
    monkeypatch.setattr(copy, "copy", lambda x: calls.append(x) or x)
    todevice.move({"a": [torch.ones(1)], "b": helpers.TaggedDict("t", {})}, "meta")
    assert calls == []


class _PinRecorder(torch.Tensor):
    """A CPU tensor that says whether it is pinned and records how .to() is called."""

    pinned = False
    calls: ClassVar[list[Any]] = []

    def is_pinned(self, *args: Any, **kwargs: Any) -> bool:
        return self.pinned

    def to(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        _PinRecorder.calls.append(kwargs.get("non_blocking"))
        return self


@pytest.mark.parametrize(("pinned", "expected"), [(False, False), (True, True)])
def test_mps_copies_from_pageable_memory_are_blocking(
    pinned: bool, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Async pageable-to-MPS copies can return zeros (pytorch#83015): only pinned sources go async."""
    t = torch.Tensor._make_subclass(_PinRecorder, torch.ones(2))
    t.pinned = pinned
    _PinRecorder.calls = []
    monkeypatch.setattr(_stream, "resolve_device", lambda device, *args, **kwargs: device)  # no MPS here
    _move.plan(torch.device("mps", 0), True, None).to(t)  # type: ignore[union-attr]  # never None with an index
    assert _PinRecorder.calls == [expected]


@pytest.mark.parametrize(
    ("device", "nbytes", "pinned", "waited", "expected"),
    [
        ("cuda:0", 16, False, True, True),
        ("cuda:0", 16, False, False, True),
        ("mps:0", 16, False, True, False),  # pytorch#83015: only a pinned source goes async
        ("mps:0", 16, True, True, True),
        ("mps:0", None, False, True, False),  # an object's own .to(), whose tensors are not seen
        ("cpu", 16, False, True, True),  # lands in page-locked memory, waited for before move() returns
        ("cpu", _layout.PINNED_RESULT_MAX_BYTES + 4, False, True, False),  # too large to land pinned
        ("cpu", 16, False, False, False),  # under torch.compile, or into out=: no wait, so blocking
        ("cpu", None, False, True, True),
    ],
)
def test_one_non_blocking_rule_for_every_copy(
    device: str, nbytes: int | None, pinned: bool, waited: bool, expected: bool
) -> None:
    t = None
    if nbytes is not None:
        t = torch.Tensor._make_subclass(_PinRecorder, torch.empty(nbytes // 4))
        t.pinned = pinned
    dev = torch.device(device)
    assert _layout.asynchronous(True, dev, t, waited) is expected
    assert _layout.asynchronous(False, dev, t, waited) is False


def test_out_copies_to_mps_from_pageable_memory_are_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """out='s copy of a tensor by itself follows the same rule (it passed non_blocking on as it was)."""
    seen: list[Any] = []

    class Target(torch.Tensor):
        @property
        def device(self) -> torch.device:  # type: ignore[override]
            return torch.device("mps", 0)

        @property
        def is_cpu(self) -> bool:  # type: ignore[override]
            return False

        def copy_(self, src: Any, non_blocking: bool = False) -> Any:  # type: ignore[override]
            seen.append(non_blocking)
            return self

    dst = torch.Tensor._make_subclass(Target, torch.zeros(2))
    _into._alone(torch.ones(2), dst, True)
    assert seen == [False]


# ---------------------------------------------------------------- regressions


def test_conjugate_and_negative_views_are_not_shared_with_their_base() -> None:
    """x.conj() has x's data_ptr, dtype, shape and strides, yet other values."""
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    out = todevice.move({"a": x, "b": x.conj()}, "cpu", dtype=torch.complex128)
    assert torch.equal(out["b"], x.conj().to(torch.complex128))
    t = torch.tensor([1.0, -2.0])
    out2 = todevice.move([t, torch._neg_view(t)], "cpu", dtype=torch.float64)
    assert torch.equal(out2[1], -t.double())


def test_deep_chain_of_in_place_to_objects_never_mutates_the_input() -> None:
    chain: Any = None
    for _ in range(3000):
        chain = [Moves(torch.ones(1)), chain]
    out = todevice.move(chain, "meta")
    node, moved = chain, out
    while node is not None:
        assert node[0].t.device == CPU and node[0].calls == []
        assert moved[0] is not node[0] and moved[0].t.device == META
        node, moved = node[1], moved[1]


def test_ten_thousand_levels_of_to_objects() -> None:
    chain: Any = None
    for _ in range(10_000):
        chain = [pack_padded_sequence(torch.ones(1, 1, 2), torch.tensor([1])), chain]
    out = todevice.move(chain, "meta")
    assert out[0].data.device == META and out[1][1][0].data.device == META


def test_cycle_through_to_objects_raises_the_cycle_error() -> None:
    cyc: list[Any] = [Moves(torch.ones(1))]
    cyc.append([Moves(torch.ones(1)), cyc])
    with pytest.raises(ValueError, match="Cannot move a cyclic structure"):
        todevice.move(cyc, "meta")


@pytest.mark.parametrize("device", ["hip", "hpu", "xla", "privateuseone"])
def test_device_types_without_a_backend_are_rejected_up_front(device: str) -> None:
    obj = Moves(torch.ones(1))
    with pytest.raises(ValueError, match=f"Cannot move to device '{device}': "):
        todevice.move({"o": obj, "x": 1}, device)
    assert obj.calls == []


def test_ordered_dict_subclass_keeps_its_own_order() -> None:
    class OD(collections.OrderedDict):  # type: ignore[type-arg]
        pass

    d = OD(a=torch.ones(1), b=2, c=3)
    d.move_to_end("a")
    assert list(todevice.move(d, "meta")) == ["b", "c", "a"]


def test_namedtuple_with_its_own_new() -> None:
    class Base(collections.namedtuple("Base", ["x", "y"])):
        __slots__ = ()

        def __new__(cls, x: Any, y: Any = None) -> Any:
            return super().__new__(cls, x, y)

    class Batch(Base):
        def __new__(cls, x: Any) -> Any:  # takes one argument, not two
            return super().__new__(cls, x, "default")

    out = todevice.move(Batch(torch.ones(1)), "meta")
    assert type(out) is Batch and out.x.device == META and out.y == "default"


def test_strict_lists_leaves_under_freshly_built_children() -> None:
    """A registered flatten that builds new lists: every leaf under them is still found."""

    class Unknown:
        pass

    class Holder:
        def __init__(self, a: Any) -> None:
            self.a = a

    todevice.register(Holder, lambda h: ([[h.a]], None), lambda aux, ch: Holder(ch[0][0]))
    try:
        with pytest.raises(TypeError, match=r"Cannot move 6 object\(s\)"):
            todevice.move([Holder(Unknown()) for _ in range(6)], "meta", strict=True)
    finally:
        todevice.unregister(Holder)


def test_error_in_a_registered_flatten_names_the_node() -> None:
    class Fragile:
        pass

    def flatten(obj: Fragile) -> Any:
        raise KeyError("boom")

    todevice.register(Fragile, flatten, lambda aux, ch: Fragile())
    try:
        with pytest.raises(KeyError, match=r"Cannot move \['f'\]\[0\] \(.*Fragile\) to meta: 'boom'"):
            todevice.move({"f": [Fragile()]}, "meta")
    finally:
        todevice.unregister(Fragile)


def test_error_whose_type_wants_other_arguments_is_raised_as_it_is() -> None:
    class OddError(Exception):
        def __init__(self, code: int, text: str) -> None:
            super().__init__(code, text)

    class Breaks:
        def to(self, device: Any) -> Any:
            raise OddError(7, "odd")

    with pytest.raises(OddError) as info:
        todevice.move({"b": Breaks()}, "meta")
    assert info.value.args == (7, "odd")
    assert info.value.__cause__ is not info.value


# ---------------------------------------------------------------- repeated calls, and tensors met again


@given(strategies.trees, st.sampled_from([None, torch.float16, torch.float64]), st.sampled_from(["meta", "cpu"]))
def test_repeated_moves_match_the_reference(tree: Any, dtype: torch.dtype | None, device: str) -> None:
    for _ in range(3):  # the same call gives the same result, whatever ran before it
        out = todevice.move(tree, device, dtype=dtype)
        helpers.assert_same_tree(out, helpers.reference_move(tree, device, dtype), values=device == "cpu")


def test_a_tensor_met_again_inside_an_object_is_moved_once() -> None:
    t = torch.ones(3)
    for tree in ({"x": t, "r": helpers.Record(t)}, {"x": t, "r": helpers.Record(t.view(3))}):
        out = todevice.move(tree, "meta")
        helpers.assert_same_tree(out, helpers.reference_move(tree, "meta"))
        assert out["r"].a is out["x"] or out["r"].a.data_ptr() == out["x"].data_ptr()
    cpu_out = todevice.move({"x": t, "r": helpers.Record(t.view(3))}, "cpu", dtype=torch.float64)
    cpu_out["x"][0] = 5.0
    assert cpu_out["r"].a[0] == 5.0  # tied memory stays tied


def test_a_failing_copy_names_its_path() -> None:
    with pytest.raises(
        NotImplementedError, match=r"Cannot move \['a'\]\[1\] \(Tensor of shape \(2,\), .*meta\) to cpu"
    ):
        todevice.move({"a": [torch.ones(1), torch.ones(2, device="meta")]}, "cpu")


def test_tensors_moved_are_among_the_outputs() -> None:
    tree = {"x": [torch.ones(2), torch.ones(3)], "r": helpers.Record(torch.zeros(1))}
    out, mover = moved(tree, META)
    made = {id(t) for t in mover.outputs()}
    assert {id(out["x"][0]), id(out["x"][1]), id(out["r"].a)} <= made
    assert len(made) == len(mover.outputs())  # each once


def test_a_tensor_met_again_after_a_tied_one_is_the_same_result() -> None:
    t = torch.ones(3)
    for tree in ({"a": t.detach(), "b": t, "c": t}, {"t": t, "x": [helpers.Record(t.detach()), helpers.Record(t)]}):
        out = todevice.move(tree, "meta")
        if "b" in out:
            assert out["b"] is out["c"]
        else:
            assert out["t"] is out["x"][1].a


def test_a_batch_whose_objects_hold_its_tensors_is_moved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host target the first walk copies without a memo; a tensor it met twice costs one copy more,
    then the careful walk runs with the memo and reuses the copies. The careful walk alone, an
    accelerator's only walk, copies each tensor once."""
    calls: list[int] = []
    real = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    a, x = torch.ones(2), torch.zeros(3)
    for _ in range(3):
        calls.clear()
        tree = {"a": a, "b": x, "r": helpers.Record(a)}
        out = todevice.move(tree, META)
        assert len(calls) == 3 and out["r"].a is out["a"]
        calls.clear()
        out, mover = moved(tree, META)
        assert len(calls) == 2 and out["r"].a is out["a"]
        assert {id(t) for t in mover.outputs()} == {id(out["a"]), id(out["b"])}
    calls.clear()
    todevice.move({"a": a, "b": x, "r": helpers.Record(torch.ones(4))}, META)  # nothing met twice: one walk
    assert len(calls) == 3


def test_a_cycle_through_an_object_is_reported_from_the_top() -> None:
    root: dict[str, Any] = {"x": torch.ones(2), "rec": None}
    root["rec"] = helpers.Record(a=[root], b=1)
    with pytest.raises(ValueError, match=r"the dict at the top level contains itself at \['rec'\]\.a\[0\]"):
        todevice.move(root, "meta")


def test_dict_keys_are_the_batch_s_own_objects() -> None:
    for i in range(5):
        key, big = "".join(["ke", "y"]), int("12345678901234567890")  # new objects for every batch
        out = todevice.move({key: torch.ones(2) * i, big: torch.zeros(1)}, "meta")
        first, second = out
        assert first is key and second is big
        packed = todevice.pack({key: torch.ones(2) * i, big: torch.zeros(1)}).unpack()
        first, second = packed
        assert first is key and second is big


# ---------------------------------------------------------------- state that outlived a call


def test_an_ordereddict_reordered_with_move_to_end_keeps_its_order() -> None:
    def batch() -> collections.OrderedDict[str, Any]:
        d = collections.OrderedDict([("a", torch.ones(2)), ("b", torch.zeros(3)), ("c", 1)])
        d.move_to_end("a")
        return d

    for _ in range(3):  # whatever ran before
        assert list(todevice.move(batch(), "meta")) == ["b", "c", "a"]
        assert list(todevice.move(batch(), "meta", coalesce=True)) == ["b", "c", "a"]
        assert list(todevice.pack(batch()).unpack()) == ["b", "c", "a"]
        assert list(todevice.move({"d": batch()}, "cpu", dtype=torch.float64)["d"]) == ["b", "c", "a"]


def test_classes_made_per_batch_are_not_kept_forever() -> None:
    import gc
    import weakref

    refs = []
    for i in range(5000):
        cls = collections.namedtuple(f"Batch{i}", ["x", "y"])
        refs.append(weakref.ref(cls))
        todevice.move(cls(torch.ones(1), i), "meta")
        del cls
    gc.collect()
    assert sum(r() is not None for r in refs) <= 4096


class _DeviceOnly(collections.abc.Mapping):  # type: ignore[type-arg]
    """A tokenizer-output-like mapping whose .to() takes a device and non_blocking only."""

    def __init__(self, items: dict[str, torch.Tensor]) -> None:
        self.data = dict(items)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.data[key]

    def __iter__(self) -> Any:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def to(self, device: Any, *, non_blocking: bool = False) -> _DeviceOnly:
        return _DeviceOnly({k: v.to(device, non_blocking=non_blocking) for k, v in self.data.items()})


def test_dtype_reaches_objects_with_their_own_to_and_is_never_dropped() -> None:
    from torch.nn.utils.rnn import pack_sequence

    floats = pack_sequence([torch.ones(3), torch.ones(2)])
    got = todevice.move({"seq": floats}, "cpu", dtype=torch.float16)["seq"]
    assert got.data.dtype == torch.float16 and torch.equal(got.batch_sizes, floats.batch_sizes)
    ids = pack_sequence([torch.arange(3), torch.arange(2)])
    assert todevice.move(ids, "meta", dtype=torch.float16).data.dtype == torch.int64  # integers keep theirs
    tokens = _DeviceOnly({"input_ids": torch.arange(4), "attention_mask": torch.ones(4, dtype=torch.long)})
    assert todevice.move({"t": tokens}, "meta", dtype=torch.float16)["t"]["input_ids"].is_meta  # nothing to cast
    mask = _DeviceOnly({"input_ids": torch.arange(4), "mask": torch.ones(4)})
    with pytest.raises(
        TypeError, match=r"Cannot move \['b'\]\[0\] \(_DeviceOnly\) to meta: its .to\(\) takes no dtype"
    ):
        todevice.move({"b": [mask]}, "meta", dtype=torch.float16)
    assert todevice.move({"b": [mask]}, "meta")["b"][0]["mask"].dtype == torch.float32  # without dtype=, as before


def test_device_may_be_passed_by_keyword_as_to_takes_it() -> None:
    batch = {"x": torch.ones(2), "y": [torch.zeros(1)]}
    out = todevice.move(batch, device="meta")
    assert out["x"].is_meta and out["y"][0].is_meta
    assert todevice.move(batch["x"], device="meta", dtype=torch.float16).dtype == torch.float16
    with pytest.raises(TypeError):
        todevice.move(obj=batch, device="meta")  # type: ignore[call-arg]  # the batch stays positional


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: todevice.move({"x": torch.ones(1)}, "meta", non_blocking="yes"), TypeError, r"non_blocking='yes'"),
        (lambda: todevice.move({"x": torch.ones(1)}, "meta", coalesce="auto"), TypeError, r"coalesce='auto'"),
        (
            lambda: todevice.move({"x": torch.ones(1)}, out={"x": torch.zeros(1)}, coalesce="auto"),
            TypeError,
            "coalesce",
        ),
        (
            lambda: todevice.move({"x": torch.ones(1)}, "meta", stream=object()),
            TypeError,
            r"stream takes a torch.Stream",
        ),
        (lambda: todevice.prefetch([], "meta", depth=1.5), TypeError, r"depth=1.5"),  # type: ignore[arg-type]
        (lambda: todevice.prefetch([], "meta", non_blocking="no"), TypeError, "non_blocking"),  # type: ignore[arg-type]
        (lambda: todevice.audit({"w": torch.ones(1)}), TypeError, r"audit\(\) takes an nn.Module"),  # type: ignore[arg-type]
        (lambda: todevice.guard({"w": torch.ones(1)}), TypeError, r"guard\(\) takes an nn.Module"),  # type: ignore[arg-type]
        (lambda: todevice.check(torch.ones(1), device="gpu"), ValueError, r"Cannot check against device 'gpu'"),
    ],
    ids=[
        "non_blocking",
        "coalesce",
        "out-coalesce",
        "stream",
        "depth",
        "prefetch-non_blocking",
        "audit",
        "guard",
        "check",
    ],
)
def test_bad_option_values_raise_at_once_naming_the_option(call: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call()


def test_skip_keys_takes_any_dict_key() -> None:
    batch = {0: torch.ones(1), 1: torch.ones(1), "x": torch.ones(1)}
    out = todevice.move(batch, "meta", skip_keys=0)
    assert out[0] is batch[0] and out[1].is_meta
    out = todevice.move(batch, "meta", skip_keys=[0, "x"])
    assert out[0] is batch[0] and out["x"] is batch["x"] and out[1].is_meta
    with pytest.raises(TypeError, match="keys must be hashable"):
        todevice.move(batch, "meta", skip_keys=[["unhashable"]])


def test_deep_nesting_looks_for_cycles_without_building_a_path_per_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each path is as long as the nesting is deep: building one per level made 100,000 levels quadratic."""
    from todevice import _walk

    deep: Any = torch.ones(1)
    for _ in range(3 * sys.getrecursionlimit()):
        deep = [deep]

    def no_paths(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("paths() built for a structure with no cycle")

    monkeypatch.setattr(_walk, "paths", no_paths)
    for device in ("cpu", "meta"):
        out = todevice.move(deep, device)
        for _ in range(3 * sys.getrecursionlimit()):
            out = out[0]
        assert out.device.type == device
    looped: list[Any] = [torch.ones(1)]
    looped.append({"back": looped})
    with pytest.raises(ValueError, match=r"the list at \['x'\] contains itself at \['x'\]\[1\]\['back'\]"):
        todevice.move({"x": looped}, "meta")


def test_non_blocking_is_checked_on_every_call_not_only_the_first() -> None:
    t = torch.ones(1)
    todevice.move(t, "cpu")  # the plan for non_blocking=True is made and kept
    for value in (1, "yes", None):
        with pytest.raises(TypeError, match="non_blocking"):
            todevice.move(t, "cpu", non_blocking=value)  # type: ignore[arg-type]


class _Holds:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_many_objects_left_behind_make_one_warning_naming_the_first_places_and_a_count() -> None:
    """One walk finds every place, and one warning per kind lists the first three: not a walk and a warning each."""
    batch = {"objs": [_Holds(torch.ones(1)) for _ in range(2000)], "x": torch.ones(2)}
    with pytest.warns(todevice.errors.TensorsLeftBehindWarning) as record:
        todevice.move(batch, "meta")
    (warned,) = [str(w.message) for w in record]
    assert "at ['objs'][0], ['objs'][1], ['objs'][2] and 1997 more through as it is" in warned


def test_a_left_behind_object_is_named_at_each_place_outside_skipped_items_and_inside_a_packed_batch() -> None:
    m = torch.nn.Linear(2, 2)
    with pytest.warns(todevice.errors.TensorsLeftBehindWarning, match=r"Linear at \['b'\]\[0\] through"):
        todevice.move({"keep": m, "b": [m]}, "meta", skip_keys="keep")
    with pytest.warns(todevice.errors.TensorsLeftBehindWarning, match=r"Linear at \['a'\], \['b'\]\[0\] through"):
        todevice.move({"a": m, "b": [m]}, "meta")
    with pytest.warns(todevice.errors.TensorsLeftBehindWarning, match=r"Linear at \['p'\]\['m'\] through"):
        todevice.move({"p": todevice.pack({"m": m, "x": torch.ones(1)})}, "meta")


def test_a_module_is_judged_by_its_first_parameter_and_an_iterator_of_no_tensors_is_not_warned_of() -> None:
    class Huge(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Parameter(torch.ones(1, device="meta"))

        def parameters(self, recurse: bool = True) -> Any:
            yield self.first
            raise AssertionError("only the first parameter is read")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        todevice.move({"m": Huge(), "r": iter(range(3)), "s": iter("ab"), "x": torch.ones(1)}, "meta")


def test_out_with_no_tensor_gives_out_back() -> None:
    static = {"a": 1, "b": ["x"]}
    assert todevice.move({"a": 1, "b": ["x"]}, "cpu", out=static) is static
