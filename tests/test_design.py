"""How the package is built: imports run one way, no generated code, and no state that remembers calls."""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import todevice
from todevice import _into, _layout, _move, _pack, _stream, _tree, _walk

SRC = Path(todevice.__file__).parent

# Each private module may import only those before it: data flows down this list.
LAYERS = [
    "errors",
    "_stream",
    "_options",
    "_objects",
    "_tree",
    "_walk",
    "_own_to",
    "_passed",
    "_layout",
    "_back",
    "_into",
    "_traced",
    "_move",
    "_pack",
    "_static",
    "_data",
    "_inspect",
]


def internal_imports(path: Path) -> set[str]:
    """The todevice modules ``path`` imports, anywhere in it (a function's body included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "todevice":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("todevice."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("todevice."))
    return found


@pytest.mark.parametrize("module", LAYERS)
def test_imports_run_one_way(module: str) -> None:
    imported = internal_imports(SRC / f"{module}.py")
    later = set(LAYERS[LAYERS.index(module) :])
    assert not imported & later, f"{module} imports {sorted(imported & later)}, which come after it"


def test_move_and_pack_do_not_import_each_other() -> None:
    assert "_pack" not in internal_imports(SRC / "_move.py")
    assert "_move" in internal_imports(SRC / "_pack.py")  # unpack() is move()'s, one way


def _called_in(module: Any, run: Any) -> list[str]:
    """The functions of ``module`` that ``run()`` calls, at any depth."""
    path = module.__file__
    called: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename == path:
            called.append(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return called


@pytest.mark.parametrize(
    "options",
    [{}, {"coalesce": True}, {"dtype": torch.float64}, {"skip_keys": "keep"}, {"device": "cpu"}],
    ids=["meta", "coalesced", "cast", "skip", "cpu"],
)
def test_a_move_never_calls_back_up_into_pack(options: dict[str, Any]) -> None:
    """A packed batch is a kind like any other: move() reads its buffer, layout and skeleton through _tree's rule, and
    never runs code of _pack, the layer above it."""
    packed = todevice.pack({"x": torch.ones(2), "keep": [torch.zeros(3)], "big": torch.ones(20_000)}, max_bytes=1024)
    batch = {"p": packed, "q": [packed, torch.ones(1)]}
    options = {"device": "meta", **options}
    device = options.pop("device")
    out = todevice.move(batch, device, **options)
    assert out["p"] is out["q"][0] and isinstance(out["p"]["x"], torch.Tensor)
    assert _called_in(_pack, lambda: todevice.move(batch, device, **options)) == []


@pytest.mark.parametrize("path", sorted(SRC.glob("*.py")), ids=lambda p: p.name)
def test_no_source_is_generated(path: Path) -> None:
    calls = [
        node.func.id
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in {"exec", "eval", "compile"}
    ]
    assert calls == []


# Process-wide state: the registry, and caches whose value is a pure function of their key.
ALLOWED_STATE = {
    "_tree._BUILTIN",  # the rules of the built-in containers, never changed
    "_tree._registry",  # the registry
    "_tree._kinds",  # a type's rule, cleared on registration, gone when its type dies
    "_tree._late",  # a rule torch pytree, optree or a .to() may change, with what it was worked out under
    "_tree._refs",  # the types of _kinds and _late, held weakly
    "_tree._OPTREE_NODES",  # optree's own registry, read for the rule of a type
    "_tree._generation",  # counts registration changes, so a rule worked out meanwhile is not cached
    "_move._plans",  # move()'s arguments' plan, bounded
}


def module_state(module: Any) -> set[str]:
    """Module-level mutable containers, and caches of functions, by name."""
    name = module.__name__.split(".")[-1]
    found = set()
    for attr, value in vars(module).items():
        if isinstance(value, (dict, list, set)) and not attr.startswith("__"):
            found.add(f"{name}.{attr}")
    return found


def test_process_wide_state_is_the_registry_and_bounded_caches() -> None:
    state = set().union(*(module_state(m) for m in (_tree, _stream, _walk, _layout, _into, _move)))
    assert state == ALLOWED_STATE
    cached = [
        fn
        for m in (_tree, _stream, _walk, _layout, _into, _move)
        for fn in vars(m).values()
        if isinstance(fn, functools._lru_cache_wrapper)
    ]
    assert cached and all(fn.cache_parameters()["maxsize"] is not None for fn in cached)


def test_a_plan_is_a_pure_function_of_its_key() -> None:
    _move._plans.clear()  # bounded: full of earlier tests' arguments, it could be cleared between two lookups
    first = _move.plan_for(torch.device("meta"), True, None)
    todevice.move({"x": [torch.ones(2)]}, "meta")
    todevice.move([torch.ones(3)] * 3, "cpu", dtype=torch.float64)
    assert _move.plan_for(torch.device("meta"), True, None) is first
    assert (
        first.host_walk is not None and "self" not in inspect.signature(first.host_walk.walk).parameters
    )  # the walk keeps nothing of a call


def test_one_cache_takes_the_arguments_to_a_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """move()'s arguments find their plan in ``_plans`` alone: a plan is made once per arguments, devices included."""
    assert not any(isinstance(fn, functools._lru_cache_wrapper) for fn in (_move.plan, _stream.resolve_device))
    made: list[Any] = []
    real = _move.plan
    monkeypatch.setattr(_move, "plan", lambda *args: made.append(args) or real(*args))
    _move._plans.clear()
    t = torch.ones(2)
    for _ in range(3):
        todevice.move(t, "meta")
        todevice.move({"x": t}, torch.device("meta"), skip_keys=["y"])  # a list: made a frozenset, then looked up
    assert made == [
        ("meta", True, None, frozenset()),
        (torch.device("meta"), True, None, frozenset()),  # the device and options checked first, then the keys
        (torch.device("meta"), True, None, frozenset({"y"})),
    ]


@pytest.mark.parametrize("bad", [1, 0, None, "yes"])
def test_a_refused_argument_is_refused_whatever_ran_before(bad: Any) -> None:
    """1 == True as a cache key: the plan found for True never lets non_blocking=1 through, before or after."""
    t = torch.ones(2)
    for _ in range(2):
        with pytest.raises(TypeError, match="non_blocking takes True or False"):
            todevice.move(t, "meta", non_blocking=bad)
        assert todevice.move(t, "meta").is_meta
    assert _move.plan_for("meta", True, None).non_blocking is True
    with pytest.raises(TypeError, match=r"expected a str, an int or a torch\.device"):
        todevice.move(t, False)  # equal to 0 as a key, and no device
    with pytest.raises(TypeError, match=r"expected a str, an int or a torch\.device"):
        todevice.move(t, ["meta"])  # unhashable: refused uncached, with the message


@pytest.mark.parametrize(
    "options",
    [{"coalesce_max_bytes": -1}, {"non_blocking": 1, "out": {"x": torch.ones(1)}}, {"skip_keys": [[1]]}],
    ids=["coalesce_max_bytes", "non_blocking with out", "skip_keys"],
)
def test_a_bad_device_is_named_before_any_other_option(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"Cannot move to device 'nope'"):
        todevice.move({"x": torch.ones(1)}, "nope", **options)


def test_an_accelerator_named_without_an_index_is_its_current_device_on_each_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An accelerator named without an index means its current device when the call is made: the cached plan only
    says so, and the device's own plan is found by the index current at each call, planned once per index (an
    accelerator faked by meta, which takes indices)."""
    current = [0]
    monkeypatch.setattr(_stream, "is_accelerator", lambda device: device.type == "meta")
    monkeypatch.setattr(_stream, "HOST_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(_stream, "current_index", lambda: current[0])
    _move._plans.clear()
    try:
        assert _move.plan_for("meta", True, None).dev == torch.device("meta", 0)
        current[0] = 1
        assert _move.plan_for("meta", True, None).dev == torch.device("meta", 1)
        assert _move._plans[str, "meta", True, None] == _move.Bare("meta")  # what the cache keeps for "meta" itself
        made: list[Any] = []
        real = _move.plan
        monkeypatch.setattr(_move, "plan", lambda *args: made.append(args) or real(*args))
        t = torch.ones(1)
        for index in (0, 1, 0, 1):
            current[0] = index
            assert todevice.move(t, "meta").is_meta and todevice.move({"x": t}, "meta")["x"].is_meta
            assert _move.plan_for("meta", True, None).dev == torch.device("meta", index)
        assert made == []  # both indices planned above, once each
    finally:
        _move._plans.clear()


@pytest.mark.parametrize(
    "path", sorted([*SRC.glob("_*.py"), *SRC.glob("_bench/*.py")]), ids=lambda p: str(p.relative_to(SRC))
)
def test_no_module_runs_past_700_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 700


def test_move_has_five_exits_each_named_in_its_body() -> None:
    """A reader follows move() by its exits: compiled, into static buffers, a bare tensor, the fast gate, the walks."""
    tree = ast.parse(inspect.getsource(_move))
    (fn,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "move"]
    assert len([node for node in ast.walk(fn) if isinstance(node, ast.Return)]) == 5
    body = inspect.getsource(_move).splitlines()[fn.lineno : fn.end_lineno]
    for n in range(1, 6):  # each exit, or the branch that leads to it, says which it is
        assert sum(f"# {n}. " in line for line in body) == 1, f"exit {n} is not named once"


# Where a container is told by its type outside _tree's rules (and _objects', which _tree reads): a dict, list, tuple,
# set, deque or mapping compared by identity, or named in isinstance() or issubclass(). Each is a specialisation of
# one general rule, proven equal to the general walk by a property test, or no batch walk.
TAKES_PLAIN_CONTAINERS_APART = {
    "_walk.make.walk": "the walk's rule for dict, list and tuple, inline (tests/test_move.py properties)",
    "_back.gate": "the walk of a plain dict, list or tuple of tensors in one pass (tests/test_paths.py)",
    "_back._copied": "the gate's copies, in a new container of the same kind",
    "_back.brought": "the way back of plain containers of device tensors (tests/backend/test_tdtest.py)",
    "_back._only_plain": "the way back's look: the three kinds alone",
    "_back._rebuilt": "the way back's rebuild: the three kinds alone",
    "_walk._flat_pairs": "out='s pairing of two flat dicts of tensors (tests/test_paths.py, tests/test_into.py)",
    "_walk._pair": "out='s pairing by each kind's rule; a list's or tuple's children by position, no labels",
    "_static.StaticBatch._build": "a StaticBatch's flat case: a plain dict's keys, read once",
    "_static.StaticBatch._sources": "a StaticBatch's flat case: a dict's tensors by those keys (tests/test_static.py)",
    "_own_to.copy_for_to": "no batch walk: copies an object's own attribute dicts before its .to() writes them",
    "_own_to.inside": "no batch walk: a guess at what an object with its own .to() holds, to look for tensors",
    "_own_to.rest_of_mapping": "no batch walk: whether what a mapping's own .to() gave can be written item by item",
    "_data.collate.__init__": "no batch walk: a hint where a list of samples was passed as collate_fn",
    "_own_to._copy_plain_containers": "no batch walk: the same, at any depth",
    "_own_to._items": "no batch walk: a UserDict's own dict, read in C",
    "_passed.left_behind": "no batch walk: an object's __dict__, looked at for tensors left behind",
}


CONTAINER_NAMES = frozenset(
    {"dict", "list", "tuple", "set", "frozenset", "deque", "OrderedDict", "defaultdict", "UserDict", "UserList"}
    | {"ChainMap", "Mapping", "MutableMapping", "Sequence", "_Mapping"}
)


def _names_a_container(node: ast.AST) -> bool:
    """Whether ``node`` compares a type with a container type by identity, or asks isinstance() or issubclass() of
    one."""
    if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
        named = node.comparators
    elif (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass")
    ):
        named = list(ast.walk(node.args[1])) if len(node.args) == 2 else []
    else:
        return False
    return any(
        (isinstance(c, ast.Name) and c.id in CONTAINER_NAMES)
        or (isinstance(c, ast.Attribute) and c.attr in CONTAINER_NAMES)
        for c in named
    )


def functions_taking_plain_containers_apart() -> set[str]:
    """Every function that tells a container by its type (``_names_a_container``), as module.function."""
    found = set()
    for path in sorted(SRC.glob("_*.py")):
        if path.stem in ("_tree", "_objects"):
            continue
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not _names_a_container(node):
                continue
            names, up = [], node
            while up in parents:
                up = parents[up]
                if isinstance(up, (ast.FunctionDef, ast.ClassDef)):
                    names.append(up.name)
            found.add(f"{path.stem}.{'.'.join(reversed(names))}")
    return found


def test_only_the_rules_and_their_named_specialisations_take_plain_containers_apart() -> None:
    assert functions_taking_plain_containers_apart() == set(TAKES_PLAIN_CONTAINERS_APART)
