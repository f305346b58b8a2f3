"""Hypothesis strategies: random nested structures of every supported container."""

from __future__ import annotations

import collections
from typing import Any

import torch
from hypothesis import strategies as st

import todevice
from tests import helpers
from todevice import testing

# The public strategies, where they fit: tensors and DTYPES come from todevice.testing, and batches
# makes every container kind, for tests that check with todevice.testing.assert_moved. trees keeps
# containers of its own: tests check it against helpers.reference_move, which knows helpers' classes.
DTYPES = list(testing.DTYPES)
tensors = testing.tensors
batches = testing.batches


atoms = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.sampled_from([helpers.Color.RED, torch.float32, torch.device("cpu"), torch.Size([2, 3])]),
)

leaves = st.one_of(tensors(), tensors(), atoms)  # tensors twice as likely as the rest
keys = st.text(alphabet="abcdefgh", min_size=1, max_size=3)


def _reordered(d: dict[str, Any]) -> collections.OrderedDict[str, Any]:
    """An OrderedDict whose own order differs from that of the dict underneath it."""
    out = collections.OrderedDict(sorted(d.items()))
    if len(out) > 1:
        out.move_to_end(next(iter(out)))
    return out


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    lists = st.lists(children, max_size=4)
    dicts = st.dictionaries(keys, children, max_size=4)
    hashables = st.lists(st.one_of(tensors(), st.integers(-5, 5), st.text(max_size=2)), max_size=3)
    return st.one_of(
        lists,
        lists.map(tuple),
        dicts,
        dicts.map(lambda d: collections.OrderedDict(sorted(d.items()))),
        dicts.map(_reordered),
        dicts.map(lambda d: collections.defaultdict(list, d)),
        lists.map(lambda v: collections.deque(v, maxlen=8)),
        hashables.map(set),
        hashables.map(frozenset),
        st.tuples(children, children).map(lambda p: helpers.Point(*p)),
        st.tuples(st.sampled_from(helpers.DATACLASSES), children, children).map(lambda p: p[0](p[1], p[2])),
        st.tuples(children, children).map(lambda p: helpers.make_late(*p)),
        dicts.map(lambda d: helpers.TaggedDict("t", d)),
        lists.map(lambda v: helpers.TaggedList("t", v)),
        st.tuples(children, lists).map(lambda p: helpers.TaggedTuple(*p)),
        st.tuples(children, lists).map(lambda p: helpers.TaggedDeque(p[0], p[1], maxlen=6)),
        st.tuples(children, hashables).map(lambda p: helpers.TaggedSet(*p)),
        st.tuples(children, hashables).map(lambda p: helpers.TaggedFrozenset(*p)),
    )


trees = st.recursive(leaves, _containers, max_leaves=25)


@st.composite
def trees_with_aliases(draw: st.DrawFn) -> Any:
    """A tree in which some tensors appear more than once, and some tensors share memory."""
    base = draw(tensors())
    alias_twice = [base, base]
    tied = [base.detach(), base.detach().view(base.shape)]  # distinct tensors, the very same memory
    return {"tree": draw(trees), "aliases": alias_twice, "tied": tied}


@st.composite
def shared_trees(draw: st.DrawFn) -> Any:
    """A batch whose tensors come from a small pool, so that some are met more than once, inside the kinds that hold
    them apart from the plain walk: list subclasses with an attribute, a mapping registered with torch pytree, a
    mapping with its own in-place .to() (a BatchEncoding), and packed batches (none inside another), whose loose
    tensors the rest of the batch may hold too."""
    pool = draw(st.lists(tensors(requires_grad=False), min_size=1, max_size=4))
    leaf = st.one_of(st.sampled_from(pool), st.sampled_from(pool), st.integers(0, 3))

    def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        lists = st.lists(children, max_size=3)
        dicts = st.dictionaries(st.sampled_from("abc"), children, max_size=3)
        return st.one_of(
            lists,
            lists.map(tuple),
            dicts,
            st.tuples(children, lists).map(lambda p: helpers.TaggedList(*p)),
            dicts.map(helpers.Output),
            dicts.map(helpers.Encoding),
        )

    unpacked = st.recursive(leaf, containers, max_leaves=6)
    packed = st.tuples(unpacked, unpacked).map(lambda p: {"a": p[0], "packed": todevice.pack(p[1], max_bytes=16)})
    return draw(st.recursive(st.one_of(leaf, packed), containers, max_leaves=8))
