"""move() under torch.compile: one plain walk that dynamo traces, with one ``t.to()`` per tensor.

The eager move() plans per device, finds repeated tensors by data pointer, coalesces small tensors
into one pinned buffer and waits for copies into host memory: host-side work that dynamo cannot
trace (data pointers, locks, pinned memory, writes into a byte buffer through views of other
dtypes), and that a compiled region does not need, since the compiler schedules the copies itself.
So where dynamo would inline move(), it inlines ``compiled`` instead (``_move`` sets that up, at no
cost to eager calls), and this walk copies each tensor with ``t.to(device, dtype, non_blocking=)``
and rebuilds the containers as the eager walk rebuilds them.

Traced into the graph: tensors, atoms, dict, OrderedDict, defaultdict, list, tuple, set,
frozenset, deque, namedtuples, structseqs such as ``torch.return_types``, dataclasses, nn.Modules
(kept), objects with ``.to()``, registered types (as far as their functions trace), PackedBatch, and
other leaves kept as they are (numpy values, paths, dates, functions, classes, plain objects): how
to take a type ``_form`` decides outside the graph. Other containers (dict and list subclasses,
other mappings, dataclasses with slots) go through ``_tree``'s flatten under its lock: dynamo breaks
the graph there (fullgraph=True raises), and the move runs as plain Python, which gives the eager
result. So does a set of tensors, which dynamo does not take as an input.

Where the result differs from the eager move, and why:

- ``coalesce``, ``coalesce_max_bytes`` and ``stream`` are checked, then ignored: the copies are the compiler's to
  schedule, on the current stream, which is also what makes them safe to use there.
- A copy into host memory or to MPS is blocking (``_layout.asynchronous``, with no wait before returning).
- The same tensor met twice is copied once, but distinct tensors over the same memory (tied
  weights) are copied separately: a data pointer is not known while tracing.
- Atoms come back equal, not always the very same objects: dynamo may hand back the constant it
  traced with.
- Dynamo (2.13) takes a deque in without its ``maxlen``: the copy has none.
- Dynamo before 2.12 cannot list an object's attributes (see ``LISTS_ATTRIBUTES``): a dataclass
  without ``__post_init__`` or a descriptor field is rebuilt from its fields alone, and what needs the
  list (such a dataclass, the shallow copy of a ``.to()`` object) breaks the graph with a message.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Collection, Hashable
from typing import Any

import torch

from todevice import _layout, _options, _own_to, _passed, _stream, _tree, _walk

_RELEASE = tuple(int(part) for part in torch.__version__.split(".")[:2])  # (2, 11) for "2.11.0a0+git..." too

# Dynamo before torch 2.12 reads an instance's ``__dict__`` only by key: it cannot list it
# (``vars(x).items()``, ``len(x.__dict__)``, iterating it all fail) nor call ``copy.copy``.
LISTS_ATTRIBUTES = _RELEASE >= (2, 12)  # compared as numbers: "2.9" >= "2.12" as strings

_EVAL_FRAME = torch._C._dynamo.eval_frame


def _never_compiled(fn: Callable[..., Any]) -> None:
    """Where torch can say so (2.4 can), dynamo never compiles a frame of ``fn`` on its own."""
    if hasattr(_EVAL_FRAME, "skip_code"):
        _EVAL_FRAME.skip_code(fn.__code__)


def _peeked_callback() -> Any:
    """The callback, read where torch has no getter for it (before 2.5 or so): set to None, and set back at once."""
    callback = _EVAL_FRAME.set_eval_frame(None)
    _EVAL_FRAME.set_eval_frame(callback)
    return callback


# Truthy while a torch.compile'd function runs: the callback dynamo hands each new frame to (None
# outside, False where compiled code is only replayed). A frame dynamo gives up on runs as plain
# Python with it still set, and each call that frame makes is compiled on its own: the eager move's
# host-side steps fail that way (a pinned result, a fallback in an ``except`` that dynamo does not
# take), so a move made there takes this walk too.
_eval_frame_callback: Callable[[], Any] = getattr(_EVAL_FRAME, "get_eval_frame_callback", _peeked_callback)
_never_compiled(_peeked_callback)

# Whether dynamo traces this walk: from torch 2.11. Before, it crashes on it (2.8 cannot trace
# ``frozenset.__contains__``) or gives a wrong result (2.10 hands back a frozenset of tensors empty). There move(),
# pack() and unpack() run as plain Python behind a graph break (``untraced``).
TRACES = _RELEASE >= (2, 11)


def untraced(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` from torch 2.11; before, ``fn`` run outside the graph, named ``name`` in dynamo's error."""
    why = f"{name}, which torch.compile traces from torch 2.11: torch {torch.__version__} runs it outside the graph"
    return fn if TRACES else _outside_graph(fn, why)


def _outside_graph(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn``, run as plain Python where dynamo meets it: a graph break (under fullgraph=True, dynamo's error naming
    ``name``). What ``torch.compiler.disable`` makes, without importing dynamo (a second's import, for every DataLoader
    worker): dynamo breaks the graph at a function marked ``_torchdynamo_disable``, which turns dynamo off."""

    def run(*args: Any, **kwargs: Any) -> Any:
        callback = _EVAL_FRAME.set_eval_frame(None)
        try:
            return fn(*args, **kwargs)
        finally:
            _EVAL_FRAME.set_eval_frame(callback)

    run.__name__ = run.__qualname__ = name
    run._torchdynamo_disable = True  # type: ignore[attr-defined]
    _never_compiled(run)
    return run


def compiling() -> Any:
    """Truthy under torch.compile: traced by dynamo, or run as plain Python by a compiled function. One C call, which
    dynamo cannot trace (it warns and breaks the graph): where it traces a call to this function, it traces the one
    below instead, which says True."""
    return _eval_frame_callback()


compiling._torchdynamo_inline = lambda: True  # type: ignore[attr-defined]


def compiled(
    obj: Any,
    /,
    device: Any = None,
    *,
    non_blocking: bool = True,
    dtype: torch.dtype | None = None,
    coalesce: bool | None = None,
    coalesce_max_bytes: int = _options.COALESCE_MAX_BYTES,
    stream: Any = None,
    strict: bool = False,
    skip_keys: Hashable | Collection[Hashable] | None = None,
) -> Any:
    """What dynamo traces in place of :func:`todevice.move` (but for ``out=``, copied eagerly between two graphs). Every
    option is checked as the eager move checks it, with its exception and message (``_problem``); ``coalesce``,
    ``coalesce_max_bytes`` and ``stream`` are then ignored (see the module's docstring)."""
    error, msg = _problem(device, non_blocking, dtype, coalesce, coalesce_max_bytes, None, strict, skip_keys)
    if error:  # raised in the graph: dynamo runs the call as plain Python, which raises it again
        raise (TypeError if error == "TypeError" else ValueError)(msg)
    if stream is not None:
        _stream.check_stream(stream)
    skip = _options.skip_set(skip_keys)
    h = _How(_target(device), non_blocking, dtype, skip)
    out = h.walk(obj, h)
    if strict and h.unknown:
        # The eager check, which lists every object not understood: it looks at each type through
        # _tree, so the graph breaks here, and only for a structure that holds such an object.
        _passed.refuse_unknown(obj, skip)
    return out


def _problem(*options: Any) -> tuple[str, str]:
    """What ``_options.check`` says of move()'s options, the stream None (dynamo cannot pass one in as a constant):
    ``("", "")``, or the name and message of its error, which the graph raises. Dynamo runs this as plain Python and
    keeps its result as a constant (the mark below), so it never traces torch's parsing of a device string, which fails
    inside dynamo itself; where dynamo compiles this frame on its own instead, the check it calls is left alone."""
    check = torch.compiler.disable(_options.check)  # type: ignore[no-untyped-call]
    try:
        check(*options)
    except (TypeError, ValueError) as err:
        return type(err).__name__, str(err)
    return "", ""


_problem._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _target(device: Any) -> torch.device:
    """The device checked by ``_problem``, as a constant in the graph ("cuda" stays "cuda": the current device)."""
    return _stream.resolve_device(device, current=False)


_target._dynamo_marked_constant = True  # type: ignore[attr-defined]


class _How:
    """One traced move's options, its walk, and its memos: the copy of each tensor met, by the tensor (an ``id()`` of a
    graph input would make dynamo guard on that very object, and compile again for every new batch), and the result
    of each other object moved as a whole, found by identity among the few a batch holds."""

    __slots__ = ("aliases", "copies", "dev", "dtype", "fresh", "held", "memo", "nb", "skip", "unknown", "views", "walk")

    def __init__(self, dev: torch.device, non_blocking: bool, dtype: torch.dtype | None, skip: frozenset[Any]) -> None:
        self.dev, self.dtype, self.skip = dev, dtype, skip
        self.nb = _layout.asynchronous(non_blocking, dev, waited=False)
        self.walk = _walk.make(_layout.NEVER, _tensor, _leaf, _kind, _slot, skip, _kept).walk  # _one says what stays
        self.copies: dict[torch.Tensor, torch.Tensor] = {}
        self.memo: list[tuple[Any, Any]] = []
        self.views: list[torch.Tensor] | None = None  # a packed batch's tensors, while its skeleton is walked
        self.aliases: dict[int, tuple[Any, torch.Tensor]] | None = None  # the view each AliasSlot got, with ``views``
        self.held: _How | None = None  # with ``views`` and keys to skip: how the skipped items are filled
        self.unknown = False  # whether an object that strict=True refuses was met
        self.fresh = False  # in a batch packed under torch.compile: every tensor copied, as if read from a buffer


def _tensor(t: torch.Tensor, h: _How) -> torch.Tensor:
    """``t`` moved, once however often it is met."""
    out = h.copies.get(t)  # a tensor hashes by identity
    if out is None:
        out = h.copies[t] = _one(t, h)
    return out


def _one(t: torch.Tensor, h: _How) -> torch.Tensor:
    """``t`` moved, with no memo: for a packed buffer's views, each made once (dynamo before 2.12 cannot take the
    ``id()`` of a tensor made in the graph)."""
    cast = _options.cast_to(t.dtype, h.dtype)
    if h.fresh:  # a copy, never the packed tensor itself; one that required grad, a new leaf
        return t.detach().to(h.dev, cast, non_blocking=h.nb, copy=True).requires_grad_(t.requires_grad)
    if t.device == h.dev and cast == t.dtype:
        return t
    return t.to(h.dev, cast, non_blocking=h.nb)


def _slot(x: _tree.Slot, h: _How) -> Any:
    return _tree.filled(x, h.views, h.aliases)


def _kept(x: Any, h: _How) -> Any:
    """An item under a key to skip: as it is; in a packed batch's skeleton, filled as the batch holds it."""
    return x if h.held is None else h.held.walk(x, h.held)


def _leaf(x: Any, code: int, h: _How) -> Any:
    """What the walk does with a leaf that is neither a tensor nor an atom, by its code (``_kind``)."""
    if code == _tree.SLOT:  # an AliasSlot
        return _slot(x, h)
    if code == _tree.TO:
        return _to_object(x, h)
    if code == _tree.PACKED:
        return _unpacked(x, h)
    if code == _tree.SUBSET:
        return _untraced_subset(x, h)
    h.unknown = True  # an nn.Module (its .to() moves in place: left as the eager move leaves it) or unknown
    return x


def _kind(tp: type) -> _tree.Kind:
    """The walk's ``kind_of`` as dynamo traces it: a registered or built-in container's rule, else by ``_form``."""
    kind = _tree._registry.get(tp) or _BUILTIN.get(tp)  # without the lock, as _tree reads it (kind_of takes it)
    if kind is not None:
        return kind
    at = _form(tp)
    # Where dynamo cannot trace a rule's own functions, the graph breaks there, and that part runs as Python.
    return _tree.kind_of(tp) if at == _tree.NODE else _FORMS[at]


def _form(tp: type) -> int:
    """Where ``_FORMS`` holds what the walk does with ``tp`` (NODE: a container taken by its own rule), a constant in
    the graph (the mark below is what ``torch.compiler.assume_constant_result`` sets, without importing dynamo here):
    the classification is not traced, so an unknown leaf, a numpy value or a path does not break the graph. It guards
    on ``type(x)``."""
    kind = _tree.kind_of(tp)
    return kind.form if kind.code == _tree.NODE else kind.code


_form._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _attributes(x: Any) -> tuple[list[Any], tuple[type, list[str]]]:
    """A dataclass's instance attributes, fields or not, as the eager rule lists them."""
    tp = type(x)
    if LISTS_ATTRIBUTES or _more_than_fields(tp):
        if not LISTS_ATTRIBUTES:  # the graph breaks: what follows runs as Python
            torch._dynamo.graph_break(msg=_too_old(tp, "lists the attributes of"))
        state = vars(x)
        return list(state.values()), (tp, list(state))
    attrs = x.__dict__  # before 2.12, read by key: the fields set (one with init=False and no default may be unset)
    names = [name for name in _field_names(tp) if name in attrs]
    return [attrs[name] for name in names], (tp, names)


def _attributes_set(aux: tuple[type, list[str]], children: list[Any]) -> Any:
    """A copy made without __init__, as the eager rule makes it; object.__setattr__ also writes a frozen one."""
    tp, names = aux
    out: Any = object.__new__(tp)
    for name, value in zip(names, children):
        object.__setattr__(out, name, value)
    return out


# What the walk does with each kind of leaf (by its code), and the containers taken by a form of their own.
_FORMS: tuple[_tree.Kind, ...] = (
    *(_tree.Kind(code) for code in range(_tree.STRUCTSEQ)),
    _tree.Kind(_tree.NODE, lambda x: (list(x), type(x)), lambda tp, children: tp(children)),  # a structseq
    _tree.Kind(_tree.NODE, _attributes, _attributes_set),
    _tree.Kind(_tree.SUBSET),
)


def _frozen(aux: None, children: list[Any]) -> frozenset[Any]:
    """A frozenset, made in a frame that names frozenset: dynamo (2.13) rebuilds a frozenset of tensors only there, so
    where it holds tensors the graph breaks, and this frame is compiled on its own."""
    if any(isinstance(v, torch.Tensor) for v in children) and torch.compiler.is_dynamo_compiling():
        torch._dynamo.graph_break()
    return frozenset(children)


# The built-in containers' rules, a frozenset's made by ``_frozen``.
_BUILTIN = {**_tree._BUILTIN, frozenset: _tree._BUILTIN[frozenset]._replace(unflatten=_frozen)}


def _field_names(tp: type) -> tuple[str, ...]:
    """A dataclass's field names: a constant in the graph, as ``_form``'s result is."""
    return tuple(f.name for f in dataclasses.fields(tp))


_field_names._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _more_than_fields(tp: type) -> bool:
    """Whether a dataclass's attributes may be other than its fields: a ``__post_init__`` may set more, and a field
    that is a descriptor keeps its value under a name of its own choosing."""
    return hasattr(tp, "__post_init__") or any(
        hasattr(type(inspect.getattr_static(tp, name, None)), "__set__") for name in _field_names(tp)
    )


_more_than_fields._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _too_old(tp: type, what: str) -> str:
    """Why dynamo breaks the graph at an object of type ``tp``, before torch 2.12, and what traces it."""
    return (
        f"todevice.move() {what} each {tp.__qualname__} it moves, which dynamo before torch 2.12 cannot "
        f"trace: the graph breaks here (torch.compile(fullgraph=True) raises). torch 2.12 or later traces it."
    )


_too_old._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _copied_outside(tp: type) -> str:
    """Why the graph breaks at a built-in container's subclass with its own ``.to()``."""
    return f"todevice.move() copies each {tp.__qualname__} (a container subclass with its own .to()) outside the graph"


_copied_outside._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _subset(x: Any, h: _How) -> Any:
    """A set or frozenset subclass, by its rule: made with its base's ``__new__``, which dynamo fails on."""
    kind = _tree.kind_of(type(x))
    children, aux = kind.flatten(x)  # type: ignore[misc]
    return kind.unflatten(aux, [h.walk(v, h) for v in children])  # type: ignore[misc]


# Moved as plain Python: the graph breaks there (fullgraph=True raises).
_untraced_subset = _outside_graph(_subset, "todevice.move() of a set or frozenset subclass, which dynamo cannot make")


def _met(x: Any, h: _How) -> Any:
    """What ``x`` moved to, if it was met before in this move; else None."""
    for src, out in h.memo:
        if src is x:
            return out
    return None


def _to_object(x: Any, h: _How) -> Any:
    """An object with its own ``.to()``: moved by it on a shallow copy, with the eager move's keywords
    (``_own_to.to_object``)."""
    out = _met(x, h)
    if out is not None:
        return out
    tp = type(x)
    sequence = isinstance(x, torch.nn.utils.rnn.PackedSequence)
    if not sequence and not LISTS_ATTRIBUTES:
        torch._dynamo.graph_break(msg=_too_old(tp, "makes a shallow copy of"))
    copy = _own_to.copy_for_to
    # Dynamo's copy.copy of a built-in container's subclass (its rule's base) loses its items, or fails (a tuple's, a
    # deque's; torch 2.13): made outside the graph. A namedtuple's copy traces.
    if _tree._container_base(tp) is not None and not hasattr(x, "_fields"):
        torch._dynamo.graph_break(msg=_copied_outside(tp))  # under fullgraph=True, raised with this message
        copy = torch.compiler.disable(copy)  # type: ignore[no-untyped-call]
    try:
        named = _own_to.to_keywords(x, h.nb, h.dtype, _kind)
    except TypeError as err:  # the eager move's message, without the path, which this walk does not keep
        raise TypeError(f"Cannot move a {tp.__qualname__} to {h.dev}: {err}") from None
    target = x if sequence else copy(x)
    out = _own_to.moved_by_to(target, h.dev, named)
    h.memo.append((x, out))  # before its items are walked: one that holds x itself gets out
    if _tree.to_mapping(tp):  # what its .to() left: containers in it, and keys to skip
        _own_to.rest_of_mapping(x, out, h.skip, lambda v: h.walk(v, h), h.copies.setdefault, h.dev, h.dtype)
    return out


# ---------------------------------------------------------------- packed batches


# What a batch packed under torch.compile holds: nothing in its buffer, every tensor in its skeleton.
NOTHING_PACKED = _layout.Layout((), 0, (), ())


def unpack(batch: Any, device: Any, non_blocking: bool) -> Any:
    """``PackedBatch.unpack()`` under torch.compile: its tensors moved one by one. A batch packed under torch.compile
    packed nothing (writing tensors of several dtypes into one byte buffer is an input mutation that inductor refuses,
    and the copies are the compiler's to schedule anyway): its skeleton holds the tensors, which unpacking copies, as
    the eager unpack reads copies out of the buffer. A batch packed outside is read as views of its buffer."""
    return _unpacked(batch, _How(_target(device), non_blocking, None, frozenset()))


def _unpacked(batch: Any, h: _How) -> Any:
    """A packed batch's structure, its slots filled with its tensors moved (those that required grad as new leaves)."""
    out = _met(batch, h)
    if out is not None:
        return out
    lay = batch.layout
    outer = h.views, h.aliases, h.held, h.fresh  # a packed batch inside another's skeleton fills its own slots
    if not lay.order:
        # Packed under torch.compile: copied (see unpack). Packed outside, each tensor loose: as they are, as eagerly.
        h.fresh = lay is NOTHING_PACKED
    else:
        read = _layout.read(batch.buffer, lay)
        views = [_one(v, h) for v in read]
        held = None
        if h.skip:  # the items to skip are filled where the buffer is, and nothing in them moves
            held = _How(batch.buffer.device, False, None, frozenset())
            held.views, held.aliases = read, {}
        for made in (views, read) if h.skip else (views,):
            for k in batch.requires_grad:
                made[k] = made[k].detach().requires_grad_()
        h.views, h.aliases, h.held, h.fresh = views, {}, held, False
    out = h.walk(batch.skeleton, h)
    h.views, h.aliases, h.held, h.fresh = outer
    h.memo.append((batch, out))
    return out
