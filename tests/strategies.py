"""Hypothesis strategies: random nested structures of every supported container."""

from __future__ import annotations

import collections
from typing import Any

import torch
from hypothesis import strategies as st

from tests import helpers

DTYPES = [
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Tensors of any dtype and shape: 0-dim, empty, contiguous or a non-contiguous view."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    layout = draw(st.sampled_from(["plain", "transposed", "stepped"]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    if layout == "stepped":
        shape = [*shape[:-1], (shape[-1] if shape else 1) * 2 + 1]
    base = torch.randn(shape or [], generator=gen) * 10
    t = base.to(dtype) if dtype is not torch.bool else base > 0
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif layout == "stepped" and t.dim() >= 1:
        t = t[..., ::2]
    if (dtype.is_floating_point or dtype.is_complex) and draw(st.booleans()):
        t = t.detach().requires_grad_(True)
    return t


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


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    lists = st.lists(children, max_size=4)
    dicts = st.dictionaries(keys, children, max_size=4)
    hashables = st.lists(st.one_of(tensors(), st.integers(-5, 5), st.text(max_size=2)), max_size=3)
    return st.one_of(
        lists,
        lists.map(tuple),
        dicts,
        dicts.map(lambda d: collections.OrderedDict(sorted(d.items()))),
        dicts.map(lambda d: collections.defaultdict(list, d)),
        lists.map(lambda v: collections.deque(v, maxlen=8)),
        hashables.map(set),
        hashables.map(frozenset),
        st.tuples(children, children).map(lambda p: helpers.Point(*p)),
        st.tuples(st.sampled_from(helpers.DATACLASSES), children, children).map(lambda p: p[0](p[1], p[2])),
        st.tuples(children, children).map(lambda p: helpers.make_late(*p)),
        dicts.map(lambda d: helpers.TaggedDict("t", d)),
        lists.map(lambda v: helpers.TaggedList("t", v)),
    )


trees = st.recursive(leaves, _containers, max_leaves=25)


@st.composite
def trees_with_aliases(draw: st.DrawFn) -> Any:
    """A tree in which some tensors appear more than once, and some tensors share memory."""
    base = draw(tensors())
    alias_twice = [base, base]
    tied = [base.detach(), base.detach().view(base.shape)]  # distinct tensors, the very same memory
    return {"tree": draw(trees), "aliases": alias_twice, "tied": tied}
