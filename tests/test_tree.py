"""The registry: registration rules, the optree namespace, thread safety."""

from __future__ import annotations

import collections
import dataclasses
import threading
import warnings
from typing import Any

import optree
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils import _pytree

import todevice
from tests import helpers
from todevice import _tree, _walk
from todevice.errors import TensorsLeftBehindWarning

META = torch.device("meta")


class Pair:
    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b


def flatten_pair(p: Pair) -> tuple[list[Any], None]:
    return [p.a, p.b], None


def unflatten_pair(aux: None, children: list[Any]) -> Pair:
    return Pair(*children)


@pytest.fixture
def registered_pair() -> Any:
    todevice.register(Pair, flatten_pair, unflatten_pair)
    yield Pair
    todevice.unregister(Pair)


def test_registered_type_is_moved(registered_pair: type) -> None:
    out = todevice.move({"p": Pair(torch.ones(1), [torch.zeros(1), "s"])}, "meta")
    assert type(out["p"]) is Pair
    assert out["p"].a.device == META and out["p"].b[0].device == META and out["p"].b[1] == "s"


def test_unregistered_type_passes_through() -> None:
    p = Pair(torch.ones(1), 2)
    with pytest.warns(
        TensorsLeftBehindWarning, match=r"test_tree\.Pair at the top level through as it is: the tensor in its \.a "
    ):
        assert todevice.move(p, "meta") is p


def test_unregister_restores_pass_through(registered_pair: type) -> None:
    todevice.unregister(Pair)
    p = Pair(torch.ones(1), 2)
    with pytest.warns(TensorsLeftBehindWarning):
        assert todevice.move(p, "meta") is p
    todevice.register(Pair, flatten_pair, unflatten_pair)  # for the fixture's unregister


def test_registration_leaves_optree_and_torch_pytree_alone(registered_pair: type) -> None:
    p = Pair(torch.ones(1), 2)
    assert optree.tree_leaves(p) == [p]
    assert optree.register_pytree_node.get(Pair, namespace="todevice") is None
    from torch.utils import _pytree

    assert _pytree.tree_leaves(p) == [p]


def test_registered_children_path_in_errors(registered_pair: type) -> None:
    with pytest.raises(NotImplementedError, match=r"Cannot move \['p'\]\[1\] "):
        todevice.move({"p": Pair(1, torch.empty(1, device="meta"))}, "cpu")


def test_registered_entries_name_the_children() -> None:
    class Named:
        def __init__(self, x: Any) -> None:
            self.x = x

    todevice.register(Named, lambda n: ([n.x], None, ["x"]), lambda aux, ch: Named(ch[0]))
    try:
        with pytest.raises(NotImplementedError, match=r"Cannot move \['x'\] "):
            todevice.move(Named(torch.empty(1, device="meta")), "cpu")
    finally:
        todevice.unregister(Named)


def test_register_twice_raises(registered_pair: type) -> None:
    with pytest.raises(
        ValueError,
        match=r"Cannot register Pair: it is already registered with todevice\. "
        r"Call todevice\.unregister\(Pair\) first to replace it\.",
    ):
        todevice.register(Pair, flatten_pair, unflatten_pair)


def test_register_again_after_unregister(registered_pair: type) -> None:
    todevice.unregister(Pair)
    todevice.register(Pair, flatten_pair, unflatten_pair)


def test_unregister_unknown_raises() -> None:
    with pytest.raises(ValueError, match=r"Cannot unregister Pair: it is not registered with todevice\."):
        todevice.unregister(Pair)


@pytest.mark.parametrize("cls", [dict, list, tuple, torch.Tensor])
def test_register_builtin_raises(cls: type) -> None:
    with pytest.raises(ValueError, match="it is a built-in type that todevice already handles"):
        todevice.register(cls, flatten_pair, unflatten_pair)


def test_register_non_class_raises() -> None:
    with pytest.raises(TypeError, match="expected a class, got Pair"):
        todevice.register(Pair(1, 2), flatten_pair, unflatten_pair)  # type: ignore[arg-type]


def test_register_non_callable_raises() -> None:
    with pytest.raises(TypeError, match="flatten must be callable, got int"):
        todevice.register(Pair, 3, unflatten_pair)  # type: ignore[arg-type]


def test_registration_is_by_exact_type(registered_pair: type) -> None:
    class SubPair(Pair):
        pass

    s = SubPair(torch.ones(1), 2)
    with pytest.warns(TensorsLeftBehindWarning, match="SubPair"):
        assert todevice.move(s, "meta") is s


@pytest.mark.filterwarnings("ignore::todevice.errors.TensorsLeftBehindWarning")  # each Box once unregistered
def test_threads_register_and_move_at_the_same_time() -> None:
    """Eight threads each register their own class, move trees holding it, and unregister it."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(n: int) -> None:
        cls = type(f"Box{n}", (), {"__init__": lambda self, v: setattr(self, "v", v)})
        try:
            barrier.wait()
            for _ in range(50):
                todevice.register(cls, lambda b: ([b.v], None), lambda aux, ch, cls=cls: cls(ch[0]))
                tree = {"box": cls(torch.ones(1)), "list": [helpers.Record(torch.zeros(1))]}
                out = todevice.move(tree, "meta")
                assert type(out["box"]) is cls and out["box"].v.device == META
                assert out["list"][0].a.device == META
                todevice.unregister(cls)
                assert todevice.move(tree, "meta")["box"] is tree["box"]
        except BaseException as err:  # surfaced to the main thread below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_paths_lists_every_path() -> None:
    tree = {"x": [1, helpers.Record(2, (3,))], "d": helpers.TaggedDict("t", {"k": 4})}
    paths = [p for p, _ in _walk.paths(tree)]
    assert paths == [
        "",
        "['x']",
        "['x'][0]",
        "['x'][1]",
        "['x'][1].a",
        "['x'][1].b",
        "['x'][1].b[0]",
        "['d']",
        "['d'].tag",  # an instance attribute is a child like the items
        "['d']['k']",
    ]


class Holder:
    """An object todevice does not walk, holding a tensor in an attribute."""

    def __init__(self, t: Any) -> None:
        self.t = t


def test_an_unknown_object_holding_a_tensor_warns_once_per_place_naming_it_and_the_fixes() -> None:
    with pytest.warns(TensorsLeftBehindWarning) as record:
        for _ in range(3):  # one line of the caller's: one warning (Python's default filter)
            for coalesce in (False, True):
                out = todevice.move({"h": Holder(torch.ones(1)), "x": torch.ones(2)}, "meta", coalesce=coalesce)
    assert out["h"].t.device.type == "cpu" and out["x"].is_meta
    shown = {str(w.message) for w in record}
    assert shown == {
        "move() passed a tests.test_tree.Holder at ['h'] through as it is: the tensor in its .t (and any other it "
        "holds) was not moved. Register its type with todevice.register(), give it a .to() method, or pass "
        "strict=True to make this an error."
    }
    assert all(w.filename == __file__ for w in record)  # it points at the caller's line, not into todevice


def test_objects_holding_no_tensor_and_modules_on_the_target_pass_through_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = torch.nn.Linear(1, 1).to("meta")
        batch = {
            "h": Holder("text"),
            "m": model,
            "n": Holder(3),
            "x": torch.ones(1),
            "i": iter,
        }  # a builtin, not an iterator
        out = todevice.move(batch, "meta")
    assert out["h"] is batch["h"] and out["m"] is batch["m"]
    with pytest.raises(TypeError, match=r"\['h'\]: Holder"):
        todevice.move({"h": Holder(torch.ones(1))}, "meta", strict=True)  # strict raises before any warning


class Slotted:
    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = torch.ones(1)

    def __getattr__(self, name: str) -> Any:  # answers for __dict__ too, as a proxy may
        raise RuntimeError(f"no {name} here")


def test_the_look_for_tensors_left_behind_reads_no_attribute_through_the_class() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = todevice.move({"s": Slotted(), "x": torch.ones(1)}, "meta")  # slots alone: not looked into
    assert out["x"].is_meta and out["s"].t.device.type == "cpu"


# ---------------------------------------------------------------- types registered with torch pytree or optree


class Ctx:
    """A container known only to torch.utils._pytree."""

    def __init__(self, a: Any, b: Any, note: str = "") -> None:
        self.a, self.b, self.note = a, b, note


# Registered once for the process: torch also registers it with its C++ pytree, which keeps it.
_pytree.register_pytree_node(Ctx, lambda c: ([c.a, c.b], c.note), lambda ch, note: Ctx(*ch, note))


@pytest.fixture
def pytree_ctx() -> type:
    return Ctx


def test_a_type_registered_with_torch_pytree_is_moved_through_its_flatten(pytree_ctx: type) -> None:
    batch = {"c": Ctx(torch.ones(1), [torch.zeros(2)], "kept"), "x": torch.ones(3)}
    for coalesce in (False, True):
        out = todevice.move(batch, "meta", coalesce=coalesce)
        c = out["c"]
        assert type(c) is Ctx and c.a.is_meta and c.b[0].is_meta and c.note == "kept"
    assert batch["c"].a.device.type == "cpu"  # the input is untouched
    assert todevice.devices(batch)["['c'][0]"] == torch.device("cpu")
    with pytest.raises(NotImplementedError, match=r"Cannot move \['c'\]\[1\]\[0\] "):
        todevice.move({"c": Ctx(torch.ones(1), [torch.empty(1, device="meta")])}, "cpu")


def test_todevice_registration_wins_over_torch_pytree(pytree_ctx: type) -> None:
    todevice.register(Ctx, lambda c: ([c.a], (c.b, c.note)), lambda aux, ch: Ctx(ch[0], *aux))
    try:
        out = todevice.move(Ctx(torch.ones(1), torch.ones(1)), "meta")
        assert out.a.is_meta and out.b.device.type == "cpu"  # todevice's rule moves only a
    finally:
        todevice.unregister(Ctx)


@helpers.traces
def test_torch_pytree_registered_type_traces_under_fullgraph(pytree_ctx: type) -> None:
    fn = torch.compile(lambda b: todevice.move(b, "meta"), backend="eager", fullgraph=True)
    out = fn({"c": Ctx(torch.ones(1), [torch.zeros(2)], "kept")})
    assert type(out["c"]) is Ctx and out["c"].a.is_meta and out["c"].b[0].is_meta


def test_classes_made_per_batch_die_with_their_batch() -> None:
    import gc
    import weakref

    refs = []
    for i in range(100):
        made = collections.namedtuple(f"Made{i}", ["x"])  # type: ignore[misc]
        data = dataclasses.make_dataclass(f"Data{i}", ["y"])
        sub = type(f"Dict{i}", (dict,), {})
        todevice.move([made(torch.ones(1)), data(torch.ones(1)), sub(z=torch.ones(1))], "meta")
        refs += [weakref.ref(made), weakref.ref(data), weakref.ref(sub)]
        del made, data, sub
    gc.collect()
    assert sum(r() is not None for r in refs) == 0  # the rules cached for them held none of them
    assert len(_tree._kinds.keys() | _tree._late.keys()) == len(_tree._refs) < 100


class DictProperty:
    @property
    def __dict__(self) -> Any:  # type: ignore[override]  # as a lazy proxy defines it
        raise RuntimeError("no __dict__ here")


def test_no_warning_where_nothing_was_left_behind_and_no_error_from_a_dict_property() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert todevice.move({"h": Holder(torch.ones(1))}, "cpu")["h"].t.device.type == "cpu"  # on the CPU already
        todevice.move({"d": DictProperty(), "x": torch.ones(1)}, "meta")
    with pytest.warns(TensorsLeftBehindWarning):
        todevice.move({"h": Holder(torch.ones(1))}, "cpu", dtype=torch.float16)  # it would have been cast


# ---------------------------------------------------------------- a rule given after the first move


class _Late:
    def __init__(self, x: Any) -> None:
        self.x = x


class _LateMapping(collections.abc.Mapping):  # type: ignore[type-arg]
    """A mapping whose rule is the plain mappings' until another is given."""

    def __init__(self, x: Any) -> None:
        self.data = x if isinstance(x, dict) else {"x": x}

    x = property(lambda self: self.data["x"])
    __getitem__ = lambda self, k: self.data[k]  # noqa: E731
    __iter__ = lambda self: iter(self.data)  # noqa: E731
    __len__ = lambda self: len(self.data)  # noqa: E731


def _with_torch_pytree(cls: type) -> Any:
    _pytree.register_pytree_node(cls, lambda o: ([o.x], None), lambda ch, ctx: cls(ch[0]))
    # torch 2.4 has no _deregister_pytree_node: the entry it made is taken out by hand.
    return lambda: getattr(_pytree, "_deregister_pytree_node", _pytree.SUPPORTED_NODES.pop)(cls)


def _with_optree(cls: type) -> Any:
    everywhere = getattr(optree.registry, "__GLOBAL_NAMESPACE")  # optree keeps the global namespace private
    optree.register_pytree_node(cls, lambda o: ([o.x], None), lambda aux, ch: cls(ch[0]), namespace=everywhere)
    return lambda: optree.unregister_pytree_node(cls, namespace=everywhere)


def _with_todevice(cls: type) -> Any:
    todevice.register(cls, lambda o: ([o.x], None), lambda aux, ch: cls(ch[0]))
    return lambda: todevice.unregister(cls)


def _with_to(cls: type) -> Any:
    cls.to = lambda self, *args, **kwargs: cls(self.x.to(*args, **kwargs))  # type: ignore[attr-defined]
    return lambda: None  # a class keeps the .to() it was given


@pytest.mark.parametrize("give", [_with_torch_pytree, _with_optree, _with_todevice, _with_to], ids=lambda f: f.__name__)
@pytest.mark.parametrize("base", [_Late, _LateMapping], ids=["unknown", "mapping"])
def test_a_rule_given_after_the_first_move_is_used_by_the_next(give: Any, base: type) -> None:
    cls: Any = type("Late", (base,), {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TensorsLeftBehindWarning)
        first = todevice.move([cls(torch.ones(1))], "meta")[0]
    assert first.x.device.type == ("cpu" if base is _Late else "meta")  # an unknown object stays; a mapping is walked
    before = _tree.kind_of(cls)
    undo = give(cls)
    try:
        for how in ({}, {"strict": True}, {"coalesce": True}):
            again = todevice.move([cls(torch.ones(1)), torch.ones(1)], "meta", **how)[0]
            assert type(again) is cls and again.x.device.type == "meta", how
        kind = _tree.kind_of(cls)
        if give is _with_to:
            assert kind.code == _tree.TO
        else:
            assert kind.code == _tree.NODE and kind.entry is _tree._registered_entry
    finally:
        undo()
    if give is not _with_to:
        assert _tree.kind_of(cls).code == before.code  # the registration gone: the rule it had before


def test_a_dataclass_keeps_the_rule_it_was_first_moved_with_until_todevice_register() -> None:
    """A rule that claims a type (a dataclass's) is not checked against later registrations on each move: it costs
    its every move a check. todevice.register() still takes over at once."""
    cls: Any = dataclasses.make_dataclass("Early", [("x", Any)])
    assert todevice.move([cls(torch.ones(1))], "meta")[0].x.is_meta
    undo = _with_torch_pytree(cls)
    try:
        assert _tree.kind_of(cls).entry is not _tree._registered_entry
    finally:
        undo()
    undo = _with_todevice(cls)
    try:
        assert _tree.kind_of(cls).entry is _tree._registered_entry
    finally:
        undo()


# ---------------------------------------------------------------- registries that change and keep their size


_EVERYWHERE = getattr(optree.registry, "__GLOBAL_NAMESPACE")  # optree keeps the global namespace private


class _Two:
    """An object with two tensors, ``x`` and ``y``: a rule moves what its flatten lists."""

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y


def _only_x(cls: type) -> tuple[Any, Any]:  # a flatten that keeps y aside, in its context
    return lambda o: ([o.x], o.y), lambda aux, ch: cls(ch[0], aux)


def _both(cls: type) -> tuple[Any, Any]:
    return lambda o: ([o.x, o.y], None), lambda aux, ch: cls(*ch)


def _deregister_torch(cls: type) -> None:  # torch 2.4 has no _deregister_pytree_node: the entry is taken out by hand
    getattr(_pytree, "_deregister_pytree_node", _pytree.SUPPORTED_NODES.pop)(cls)


def _register_torch(cls: type) -> None:
    flatten, unflatten = _both(cls)
    _pytree.register_pytree_node(cls, flatten, lambda ch, ctx: unflatten(ctx, ch))


def every_path(batch: Any, device: str) -> dict[str, Any]:
    """``batch`` moved each way a move goes: the walk, coalesced, packed, compiled and into ``out=``."""

    def into() -> Any:
        static = todevice.move(batch, device)
        return todevice.move(batch, out=static)

    def compiled() -> Any:
        torch._dynamo.reset()  # imports dynamo, and torch's C++ pytree with it, where no test has yet
        return torch.compile(lambda b: todevice.move(b, device), backend="eager")(batch)

    ways = {
        "walk": lambda: todevice.move(batch, device),
        "coalesced": lambda: todevice.move(batch, device, coalesce=True),
        "packed": lambda: todevice.move(todevice.pack(batch), device),
        "compiled": compiled,
        "out=": into,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a left-behind warning where the rule says so; dynamo's own
        return {name: way() for name, way in ways.items()}


@pytest.mark.parametrize("case", ["torch pytree", "optree again", "optree and another namespace"])
def test_a_rule_changed_while_a_registry_keeps_its_size_is_used_by_the_next_move_on_every_path(case: str) -> None:
    """A registration made together with a removal leaves each registry's size as it was: the next move still uses
    the new rule, on every path."""
    cls: Any = type("Changed", (_Two,), {})
    other: Any = type("Other", (_Two,), {})
    spare: Any = type("Spare", (_Two,), {})  # taken out of optree to keep its size, where torch adds to it
    optree.register_pytree_node(spare, *_both(spare), namespace="elsewhere")

    def drop_spare() -> None:
        optree.unregister_pytree_node(spare, namespace="elsewhere")

    undo = [drop_spare]
    try:
        if case == "optree again":  # x moved, y kept aside by the first flatten
            optree.register_pytree_node(cls, *_only_x(cls), namespace=_EVERYWHERE)
            undo.append(lambda: optree.unregister_pytree_node(cls, namespace=_EVERYWHERE))
        elif case == "torch pytree":
            _register_torch(other)
            undo.append(lambda: _deregister_torch(other))
        else:
            optree.register_pytree_node(other, *_both(other), namespace="elsewhere")
            undo.append(lambda: optree.unregister_pytree_node(other, namespace="elsewhere"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TensorsLeftBehindWarning)
            first = todevice.move({"o": cls(torch.ones(1), torch.ones(2))}, "meta")["o"]
        assert first.y.device.type == "cpu"  # the rule before: y stays
        counts = len(_pytree.SUPPORTED_NODES), len(optree.registry._NODETYPE_REGISTRY)
        undo.pop()()  # the removal ...
        if case == "optree again":  # ... and the registration, in the same namespace
            optree.register_pytree_node(cls, *_both(cls), namespace=_EVERYWHERE)
            undo.append(lambda: optree.unregister_pytree_node(cls, namespace=_EVERYWHERE))
        elif case == "torch pytree":
            _register_torch(cls)
            undo.append(lambda: _deregister_torch(cls))
            if len(optree.registry._NODETYPE_REGISTRY) > counts[1]:  # torch's C++ pytree (after dynamo is imported)
                optree.unregister_pytree_node(spare, namespace="elsewhere")  # registers it with optree too, for good
                undo.remove(drop_spare)
        else:
            optree.register_pytree_node(cls, *_both(cls), namespace=_EVERYWHERE)
            undo.append(lambda: optree.unregister_pytree_node(cls, namespace=_EVERYWHERE))
        assert (len(_pytree.SUPPORTED_NODES), len(optree.registry._NODETYPE_REGISTRY)) == counts
        for name, got in every_path({"o": cls(torch.ones(1), torch.ones(2)), "t": torch.ones(1)}, "meta").items():
            assert type(got["o"]) is cls and got["o"].x.is_meta and got["o"].y.is_meta, name
    finally:
        for step in undo:
            step()


_OPS = st.lists(
    st.tuples(st.integers(0, 2), st.sampled_from(["optree x", "optree both", "elsewhere"])), min_size=1, max_size=8
)


@given(_OPS)
@settings(max_examples=40, deadline=None)
def test_registries_that_change_at_a_constant_size_always_give_the_rule_registered_now(ops: list[Any]) -> None:
    """Three classes, each registered with optree in another namespace than the global one (which move() does not
    read), then given new rules one step at a time: taken out where it is and registered again, in optree's global
    namespace (moving x, or x and y) or in the other, so optree's registry keeps its size. After each step, every
    class moves as the plain model of the registry says, with and without coalescing."""
    pool: list[Any] = [type(f"C{i}", (_Two,), {}) for i in range(3)]
    where: dict[int, str] = {}  # class index -> where it is registered now

    def register(i: int, how: str) -> None:
        cls = pool[i]
        namespace = "elsewhere" if how == "elsewhere" else _EVERYWHERE
        optree.register_pytree_node(cls, *(_only_x if how == "optree x" else _both)(cls), namespace=namespace)
        where[i] = how

    def unregister(i: int) -> None:
        namespace = "elsewhere" if where.pop(i) == "elsewhere" else _EVERYWHERE
        optree.unregister_pytree_node(pool[i], namespace=namespace)

    def expected(i: int) -> tuple[str, str]:  # the devices of x and y after a move to meta
        how = where[i]
        if how == "elsewhere":
            return "cpu", "cpu"  # an unknown object: left as it is
        return ("meta", "cpu") if how == "optree x" else ("meta", "meta")

    def check() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TensorsLeftBehindWarning)
            for coalesce in (None, True):
                out = todevice.move([c(torch.ones(1), torch.ones(2)) for c in pool], "meta", coalesce=coalesce)
                got = [(o.x.device.type, o.y.device.type) for o in out]
                assert got == [expected(j) for j in range(len(pool))], (ops, where)

    try:
        for i in range(len(pool)):
            register(i, "elsewhere")
        check()
        size = len(optree.registry._NODETYPE_REGISTRY)
        for i, how in ops:
            unregister(i)
            register(i, how)
            assert len(optree.registry._NODETYPE_REGISTRY) == size
            check()
    finally:
        for i in list(where):
            unregister(i)


def test_a_class_registered_with_optree_then_unregistered_dies_with_its_last_instance() -> None:
    """The check of a late rule holds the functions optree's entry holds, never the entry, which holds the class."""
    import gc
    import weakref

    cls: Any = type("Passing", (_Two,), {})
    optree.register_pytree_node(cls, lambda o: ([o.x, o.y], None), _both(_Two)[1], namespace=_EVERYWHERE)
    todevice.move([cls(torch.ones(1), torch.ones(1))], "meta")
    optree.unregister_pytree_node(cls, namespace=_EVERYWHERE)
    ref = weakref.ref(cls)
    del cls
    gc.collect()
    assert ref() is None
