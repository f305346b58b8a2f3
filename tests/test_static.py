"""StaticBatch and static(): static buffers held in an object, fed a batch each step as move(batch, out=static) feeds
them, with the targets' checks made once."""

from __future__ import annotations

import copy
import random
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, strategies as st

import todevice
from tests import helpers, strategies
from todevice import _layout, _options

pytestmark = pytest.mark.filterwarnings("ignore:Casting complex values to real discards:UserWarning")


def batch(seed: int, n: int = 100) -> dict[str, torch.Tensor]:
    """The bench's batch: 90 float32[16] and 10 int64[8], pageable."""
    g = torch.Generator().manual_seed(seed)
    out = {f"x{i}": torch.randn(16, generator=g) for i in range(n - n // 10)}
    out.update({f"ids{i}": torch.randint(0, 1000, (8,), generator=g) for i in range(n // 10)})
    return out


def distinct(tree: Any) -> list[torch.Tensor]:
    """Each tensor of ``tree`` once, in the oracle's walk order."""
    found: list[torch.Tensor] = []
    helpers.reference_move(tree, "cpu", leaf=lambda t: found.append(t) or t)
    return found


def targets_like(tree: Any, dtype: torch.dtype | None, one_buffer: bool) -> tuple[Any, list[torch.Tensor]]:
    """Zeroed static targets with ``tree``'s structure (``dtype`` cast as move() casts), and its tensors in walk
    order: views of one host buffer laid out as coalescing lays it out, or each its own memory."""
    sources = distinct(tree)
    dtypes = [_options.cast_to(t.dtype, dtype) for t in sources]
    if one_buffer and sources:
        lay = _layout.layout(tuple(dtypes), tuple(t.shape for t in sources), None)
        made = _layout.read(torch.zeros(lay.nbytes, dtype=torch.uint8), lay)
    else:
        made = [torch.zeros(t.shape, dtype=d) for t, d in zip(sources, dtypes)]
    by_id = {id(t): m for t, m in zip(sources, made)}
    return helpers.reference_move(tree, "cpu", leaf=lambda t: by_id[id(t)]), made


def outcome(call: Any) -> Any:
    try:
        return ("returned", call())
    except (ValueError, TypeError) as err:
        return (type(err), str(err))


# ---------------------------------------------------------------- the same result as out=


# Structures of tensors only, the kind a loop feeds static buffers, beside trees of every kind.
dense = st.recursive(
    strategies.tensors(),
    lambda c: st.one_of(
        st.lists(c, max_size=4),
        st.dictionaries(strategies.keys, c, max_size=4),
        st.tuples(c, c).map(lambda p: helpers.Point(*p)),
    ),
    max_leaves=20,
).map(lambda t: {"tree": t})
flat = st.dictionaries(strategies.keys, strategies.tensors(), min_size=1, max_size=12)


@given(
    st.one_of(strategies.trees_with_aliases(), dense, flat),
    st.booleans(),
    st.sampled_from([None, torch.float64]),
    st.booleans(),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_a_static_batch_gives_out_s_result(
    tree: Any, one_buffer: bool, dtype: Any, skip: bool, grad: bool, rnd: random.Random
) -> None:
    # Two identical sets of targets, one fed by the handle and one by out=, each with two batches: the tree's values,
    # some of its tensors replaced by a target of the same shape and dtype from another path (a source over a target,
    # read first), then other values, a flat dict's keys in another order. Tied tensors would give targets that share
    # memory, which both refuse.
    tree = {k: v for k, v in tree.items() if k != "tied" and not (one_buffer and k == "aliases")}  # one buffer: once
    tree["lengths"] = torch.arange(3)  # skipped, with skip_keys: paired by neither
    skip_keys = "lengths" if skip else None
    (mine, my_targets), (theirs, their_targets) = (targets_like(tree, dtype, one_buffer) for _ in range(2))
    sources = distinct(tree)
    swaps = {}
    for i, t in enumerate(sources):
        like = [
            j
            for j, s in enumerate(my_targets)
            if s.shape == t.shape and _options.cast_to(s.dtype, dtype) == (my_targets[i].dtype)
        ]
        if like and rnd.random() < 0.3:
            swaps[i] = rnd.choice(like)

    def batches(targets: list[torch.Tensor]) -> list[Any]:
        index = {id(t): i for i, t in enumerate(sources)}
        first = helpers.reference_move(
            tree, "cpu", leaf=lambda t: targets[swaps[index[id(t)]]] if index[id(t)] in swaps else t
        )
        second = helpers.reference_move(
            tree, "cpu", leaf=lambda t: t.detach().clone().flip(0) if t.dim() else t.detach().clone()
        )
        return [first, dict(reversed(second.items()))]

    options = {"dtype": dtype, "skip_keys": skip_keys}
    with torch.set_grad_enabled(grad):
        got = outcome(lambda: [todevice.StaticBatch(mine, **options)(b) for b in batches(my_targets)])
        expected = outcome(lambda: [todevice.move(b, out=theirs, **options) for b in batches(their_targets)])
    if got[0] == "returned":
        assert expected[0] == "returned", expected
        assert all(r is mine for r in got[1])
        helpers.assert_same_tree(mine, theirs)
    else:
        assert got == expected


# ---------------------------------------------------------------- one buffer: a step, and what it checks


def test_static_allocates_one_buffer_with_the_example_s_values_and_a_step_copies_a_batch_into_it() -> None:
    example = {"x": torch.randn(4, 3), "ids": torch.arange(4), "name": "b", "w": torch.ones(2, requires_grad=True)}
    feed = todevice.static(example, "cpu")
    assert repr(feed) == "StaticBatch(3 tensors in one buffer)"
    static = feed.static
    assert static["name"] == "b" and not static["w"].requires_grad
    assert len({t.untyped_storage().data_ptr() for t in (static["x"], static["ids"], static["w"])}) == 1
    assert all(torch.equal(static[k], example[k]) for k in ("x", "ids", "w"))
    assert static["x"].data_ptr() != example["x"].data_ptr()  # its own memory
    nxt = {"x": torch.randn(4, 3), "ids": torch.arange(4) + 7, "name": "c", "w": torch.zeros(2)}
    assert feed(nxt) is static
    assert all(torch.equal(static[k], nxt[k]) for k in ("x", "ids", "w")) and static["name"] == "b"


def test_static_casts_the_floating_point_buffers_with_dtype() -> None:
    feed = todevice.static({"x": torch.randn(3), "ids": torch.arange(3)}, "cpu", dtype=torch.float64)
    assert feed.static["x"].dtype == torch.float64 and feed.static["ids"].dtype == torch.int64
    b = {"x": torch.randn(3), "ids": torch.arange(3)}
    feed(b)
    assert torch.equal(feed.static["x"], b["x"].double())


def test_static_refuses_an_example_with_tensors_it_cannot_lay_out() -> None:
    with pytest.raises(
        ValueError, match=r"1 of its tensors or objects are not plain dense tensors .*todevice.StaticBatch\(\)"
    ):
        todevice.static({"x": torch.ones(3).to_sparse()}, "cpu")


def test_a_one_buffer_step_writes_with_one_staging_write_and_one_copy() -> None:
    feed = todevice.static(batch(0), "meta")  # views of one meta buffer: a copy that moves nothing, counted
    with helpers.Copies() as seen:
        feed(batch(1))
    assert seen.log == [("cpu", "meta", feed._step.lay.nbytes)]  # one copy into the buffer, after one staging write


def test_the_batch_s_keys_may_come_in_another_order() -> None:
    feed = todevice.static(batch(0), "cpu")
    b = batch(1)
    feed(dict(reversed(list(b.items()))))
    assert all(torch.equal(feed.static[k], b[k]) for k in b)


CHANGES = {
    "a shape": (
        lambda b: b.update(x3=torch.randn(17)),
        r"at \['x3'\], out's tensor has shape \(16,\) and the batch's \(17,\)",
    ),
    "the shape of a whole block": (
        lambda b: b.update({k: torch.randn(15) for k in b if k.startswith("x")}),
        r"at \['x0'\], out's tensor has shape \(16,\)",
    ),
    "a broadcastable shape": (lambda b: b.update(x5=torch.randn(1)), r"at \['x5'\], out's tensor has shape"),
    "a broadcastable shape for a tensor of a shape of its own": (
        lambda b: b.update(odd2=torch.randn(1)),
        r"at \['odd2'\], out's tensor has shape \(2, 3\) and the batch's \(1,\)",
    ),
    "a dtype into a block that would promote it": (
        lambda b: b.update(ids2=torch.randint(0, 9, (8,), dtype=torch.int32)),
        r"at \['ids2'\], out's tensor is torch.int64 and the batch's is torch.int32",
    ),
    "a dtype": (lambda b: b.update(x7=torch.randn(16).double()), r"at \['x7'\], out's tensor is torch.float32"),
    "a key": (lambda b: b.update(other=b.pop("x0")), r"the keys differ"),
    "a tensor for a number": (
        lambda b: b.update(x1=3),
        r"at \['x1'\], out holds Tensor of shape \(16,\), torch.float32, on cpu where the batch has int",
    ),
    "a tensor requiring grad": (
        lambda b: b.update(x2=torch.randn(16, requires_grad=True)),
        r"at \['x2'\], the batch's tensor requires grad",
    ),
    "a sparse tensor": (
        lambda b: b.update(x4=torch.randn(16).to_sparse()),
        r"at \['x4'\], the batch holds a Tensor of shape \(16,\), torch.float32, sparse_coo",
    ),
    "a meta tensor": (lambda b: b.update(x6=torch.empty(16, device="meta")), r"at \['x6'\], the batch holds"),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_a_changed_batch_raises_naming_its_path_before_anything_is_written(change: str) -> None:
    def made(seed: int) -> dict[str, torch.Tensor]:  # blocks of one shape, and a tensor of a shape of its own
        return {**batch(seed), "odd": torch.randn(5), "odd2": torch.randn(2, 3)}

    feed = todevice.static(made(0), "cpu")
    before = {k: t.clone() for k, t in feed.static.items()}
    b = made(1)
    edit, message = CHANGES[change]
    edit(b)
    with warnings.catch_warnings(), pytest.raises(ValueError, match=message):
        warnings.simplefilter("default")  # as in a loop: a warning (an out= resized) is no error there
        feed(b)
    assert all(torch.equal(feed.static[k], before[k]) for k in before)  # nothing written
    good = made(2)
    feed(good)  # and the handle still works
    assert all(torch.equal(feed.static[k], good[k]) for k in good)


def test_a_changed_dtype_under_no_grad_and_in_a_nested_structure_raises_too() -> None:
    feed = todevice.static({"a": [torch.zeros(4), torch.zeros(4)], "b": (torch.zeros(2, dtype=torch.long),)}, "cpu")
    with torch.no_grad(), pytest.raises(ValueError, match=r"at \['a'\]\[1\], out's tensor is torch.float32"):
        feed({"a": [torch.ones(4), torch.ones(4, dtype=torch.float16)], "b": (torch.ones(2, dtype=torch.long),)})
    assert feed.static["a"][0].eq(0).all()
    feed({"a": [torch.ones(4), torch.full((4,), 2.0)], "b": (torch.ones(2, dtype=torch.long),)})
    assert feed.static["a"][1].eq(2).all() and feed.static["b"][0].eq(1).all()


def test_a_source_over_the_static_buffers_is_read_first() -> None:
    feed = todevice.static([torch.full((2,), float(i)) for i in range(4)], "cpu")
    s = feed.static
    feed([s[1], s[2], s[3], torch.full((2,), 9.0)])  # a rolling buffer: each reads its neighbour before it is written
    assert [int(t[0]) for t in s] == [1, 2, 3, 9]
    feed([s[1], s[0], s[2], s[3]])  # a swap
    assert [int(t[0]) for t in s] == [2, 1, 3, 9]


# ---------------------------------------------------------------- targets changed behind the handle


def test_a_resized_target_is_found_and_nothing_is_written() -> None:
    feed = todevice.static(batch(0), "cpu")
    feed.static["x0"].resize_(1 << 20)  # the buffer's memory moves
    with pytest.raises(ValueError, match=r"buffer's memory was moved or shrunk .* Build a new StaticBatch"):
        feed(batch(1))


def test_a_storage_shrunk_in_place_is_found() -> None:
    feed = todevice.static(batch(0), "cpu")
    feed.static["x0"].untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"moved or shrunk"):
        feed(batch(1))


def test_a_tensor_put_into_the_structure_is_found() -> None:
    feed = todevice.static(batch(0), "cpu")
    feed.static["x3"] = torch.zeros(16)
    with pytest.raises(ValueError, match=r"it holds other tensors than those it was built on"):
        feed(batch(1))
    nested = todevice.StaticBatch({"a": [torch.zeros(2)], "b": torch.zeros(3)})
    nested.static["a"][0] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"other tensors"):
        nested({"a": [torch.ones(2)], "b": torch.ones(3)})


def test_the_static_tensors_swapped_between_paths_are_written_by_their_new_paths() -> None:
    feed = todevice.StaticBatch({"a": torch.zeros(2), "b": torch.zeros(2)})
    s = feed.static
    s["a"], s["b"] = s["b"], s["a"]
    feed({"a": torch.ones(2), "b": torch.full((2,), 2.0)})
    assert s["a"].eq(1).all() and s["b"].eq(2).all()


# ---------------------------------------------------------------- built once: the targets' checks, the options


def test_targets_that_cannot_be_written_are_refused_when_the_handle_is_built() -> None:
    with pytest.raises(ValueError, match=r"at \['e'\], out's tensor .* cannot be written in place"):
        todevice.StaticBatch({"x": torch.zeros(3), "e": torch.zeros(1).expand(4)})
    base = torch.zeros(6)
    with pytest.raises(ValueError, match=r"at \['b'\], out's tensor shares memory with the one at \['a'\]"):
        todevice.StaticBatch({"a": base[:4], "b": base[2:]})
    with pytest.raises(ValueError, match=r"a set, whose items have no order"):
        todevice.StaticBatch({"s": {torch.zeros(1)}})


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"non_blocking": 1}, TypeError, r"non_blocking=1: non_blocking takes True or False"),
        ({"dtype": torch.int64}, TypeError, r"dtype must be a floating-point or complex"),
        ({"strict": None}, TypeError, r"strict=None"),
        ({"skip_keys": [[1]]}, TypeError, r"keys must be hashable"),
    ],
)
def test_a_bad_option_is_refused_as_move_refuses_it(options: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        todevice.StaticBatch({"x": torch.zeros(2)}, **options)


def test_strict_refuses_an_unknown_object_in_the_batch() -> None:
    class Opaque:
        pass

    feed = todevice.StaticBatch({"x": torch.zeros(2), "o": 1}, strict=True)
    with pytest.raises(TypeError, match="Opaque"):
        feed({"x": torch.ones(2), "o": Opaque()})


def test_no_state_is_kept_but_the_handle_s_a_step_costs_the_same_whatever_ran_before() -> None:
    feed = todevice.static(batch(0), "cpu")
    bad = batch(1)
    bad["x1"] = torch.randn(16, requires_grad=True)
    with pytest.raises(ValueError):
        feed(bad)  # the held staging buffer was part of a graph: replaced
    assert not any(region.requires_grad for _, region in feed._held[2])
    good = batch(3)
    with helpers.Copies() as seen:
        feed(good)
    assert len(seen.pairs) == 1 and all(torch.equal(feed.static[k], good[k]) for k in good)


def test_a_deep_copy_of_the_handle_feeds_its_own_buffers() -> None:
    feed = todevice.static(batch(0), "cpu")
    twin = copy.deepcopy(feed)
    b = batch(4)
    twin(b)
    assert all(torch.equal(twin.static[k], b[k]) for k in b)
    assert not all(torch.equal(feed.static[k], b[k]) for k in b)


# ---------------------------------------------------------------- what a step writes, and what it leaves


def test_the_bytes_between_targets_that_are_part_of_a_larger_tensor_are_never_written() -> None:
    big = torch.arange(8.0).view(2, 4)
    feed = todevice.StaticBatch({"a": big[0, :3], "b": big[1, :3]})  # laid out as coalescing lays them out
    assert repr(feed) == "StaticBatch(2 tensors in one buffer)"
    feed({"a": torch.zeros(3), "b": torch.ones(3)})
    assert big.tolist() == [[0.0, 0.0, 0.0, 3.0], [1.0, 1.0, 1.0, 7.0]]


def test_static_s_own_buffer_is_sent_in_one_copy_padding_and_all() -> None:
    example = {"x": [torch.randn(3) for _ in range(20)], "odd": torch.randn(5), "ids": torch.arange(3)}  # padded
    feed = todevice.static(example, "meta")
    with helpers.Copies() as seen:
        feed(example)
    into_buffer = [c for c in seen.log if c[1] == "meta"]  # not the staging write's own copies
    assert into_buffer == [("cpu", "meta", feed._step.lay.nbytes)]
    mine = todevice.StaticBatch(todevice.move(example, "meta", coalesce=True))  # a buffer it did not make
    with helpers.Copies() as seen:
        mine(example)
    # A copy per group, none over the padding: the block of 20 float32[3] in a copy_(), the tensors of a shape of
    # their own in a _foreach_copy_() per dtype, which this log leaves out.
    assert [c for c in seen.log if c[1] == "meta"] == [("cpu", "meta", 60)]


def test_keys_renamed_or_swapped_behind_the_handle_are_read_as_they_are_now() -> None:
    feed = todevice.static({"a": torch.zeros(2), "b": torch.zeros(2)}, "cpu")
    ta, tb = feed.static["a"], feed.static["b"]
    feed.static.clear()
    feed.static.update(b=ta, a=tb)  # the same tensors in the same order, under each other's key
    feed({"a": torch.ones(2), "b": torch.full((2,), 2.0)})
    assert tb.eq(1).all() and ta.eq(2).all()
    feed.static["x"] = feed.static.pop("a")
    with pytest.raises(ValueError, match=r"the keys differ: the batch has \['a'\] that out has not"):
        feed({"a": torch.ones(2), "b": torch.ones(2)})


def test_a_change_to_a_tensor_s_strides_is_not_seen_and_the_step_writes_the_bytes_it_found() -> None:
    feed = todevice.static({"x": torch.zeros(2, 3), "y": torch.zeros(4)}, "cpu")
    feed.static["x"].t_()  # documented: not seen; the buffer's bytes are written as before, inside the buffer
    x = torch.arange(6.0).view(2, 3)
    feed({"x": x, "y": torch.ones(4)})
    assert feed.static["x"].t().tolist() == x.tolist() and feed.static["y"].eq(1).all()


def test_a_nested_tensor_where_a_shape_is_read_gets_out_s_error() -> None:
    feed = todevice.static({"x": torch.zeros(2, 3), "odd": torch.zeros(5)}, "cpu")
    nested = torch.nested.nested_tensor([torch.ones(5)])
    expected = r"at \['odd'\], the batch holds a Tensor .*nested.*which out= does not copy"
    with pytest.raises(ValueError, match=expected):
        feed({"x": torch.ones(2, 3), "odd": nested})
    with pytest.raises(ValueError, match=expected):
        todevice.move({"x": torch.ones(2, 3), "odd": nested}, out=copy.deepcopy(feed.static))


def test_every_static_tensor_is_marked_written_for_autograd() -> None:
    feed = todevice.static({"a": torch.zeros(3), "b": torch.ones(2)}, "cpu")
    w = torch.ones(2, requires_grad=True)
    y = (w * feed.static["b"]).sum()  # saved for backward; the step writes through a view of "a"'s first byte
    feed({"a": torch.full((3,), 7.0), "b": torch.full((2,), 5.0)})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_static_s_buffers_share_one_version_counter_so_a_step_marks_each_at_no_cost() -> None:
    feed = todevice.static({"a": torch.zeros(3), "b": [torch.ones(2), torch.arange(4)], "c": "kept"}, "cpu")
    assert feed._step is not None and feed._step.targets == []  # the one write through the buffer marks them all
    tensors = [feed.static["a"], *feed.static["b"]]
    before = [t._version for t in tensors]
    feed({"a": torch.ones(3), "b": [torch.zeros(2), torch.arange(4) + 1], "c": "other"})
    assert all(t._version > v for t, v in zip(tensors, before)) and feed.static["c"] == "kept"
    mine = todevice.StaticBatch(helpers.one_buffer({"a": torch.zeros(4), "b": torch.zeros(4)}))
    assert mine._step is not None and [id(t) for t in mine._step.targets] == [id(mine.static["b"])]  # a's is the span's


def test_a_tensor_met_twice_in_the_example_is_one_static_tensor() -> None:
    t = torch.randn(3)
    feed = todevice.static({"a": t, "b": [t]}, "cpu")
    assert feed.static["a"] is feed.static["b"][0]
    b = torch.randn(3)
    feed({"a": b, "b": [b]})
    assert torch.equal(feed.static["a"], b)


def test_static_refuses_a_dtype_it_cannot_cast_to_before_anything_is_allocated() -> None:
    with pytest.raises(TypeError, match=r"dtype must be a floating-point or complex"):
        todevice.static({"x": torch.zeros(2)}, "cpu", dtype=torch.int64)
