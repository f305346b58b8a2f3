"""Tensors that are not dense with memory of their own: sparse, nested, and functorch's wrappers (inside
``torch.func.vmap`` or ``grad``). pack() and coalescing leave them out of the buffer and move each by itself, and
out= refuses them with its ValueError, naming the path, before anything is written."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

import todevice
from tests import helpers, strategies

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning"),
    pytest.mark.filterwarnings("ignore:Casting complex values to real discards:UserWarning"),
]

KINDS = ["sparse_coo", "sparse_csr", "nested", "jagged", "vmap"]


def under(kind: str, check: Any) -> None:
    """``check(t)`` with a tensor of ``kind`` (``helpers.exotic``); for "vmap", inside torch.func.vmap, which hands it a
    wrapper."""
    if kind != "vmap":
        check(helpers.exotic(kind))
        return

    def step(x: torch.Tensor) -> torch.Tensor:
        check(x)
        return x

    torch.func.vmap(step)(torch.arange(12.0).reshape(3, 4))


@st.composite
def batches_with(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    """Dense tensors under keys k0, k1, ..., and the place where an exotic one goes among them."""
    dense = draw(st.lists(strategies.tensors(requires_grad=False), min_size=1, max_size=6))
    return {f"k{i}": t for i, t in enumerate(dense)}, draw(st.integers(0, len(dense)))


def with_exotic(batch: dict[str, Any], at: int, t: torch.Tensor) -> dict[str, Any]:
    items = list(batch.items())
    items.insert(at, ("exotic", t))
    return dict(items)


@given(batches_with(), st.sampled_from(KINDS))
@settings(max_examples=60)
def test_pack_leaves_it_in_the_structure_and_packs_the_rest(case: tuple[dict[str, Any], int], kind: str) -> None:
    batch, at = case

    def check(t: torch.Tensor) -> None:
        b = with_exotic(batch, at, t)
        packed = todevice.pack(b, max_bytes=None)
        assert packed.skeleton["exotic"] is t  # not in the buffer
        out = packed.unpack()
        assert out["exotic"] is t
        for k, v in batch.items():
            assert torch.equal(out[k], v) and out[k].dtype == v.dtype

    under(kind, check)


@given(batches_with(), st.sampled_from(KINDS), st.sampled_from(["meta", "cpu"]))
@settings(max_examples=60)
def test_coalescing_moves_it_by_itself_and_the_rest_together(
    case: tuple[dict[str, Any], int], kind: str, device: str
) -> None:
    """As the plain reference moves each tensor: to meta, and to cpu with a cast (so every tensor is copied)."""
    batch, at = case
    dtype = torch.float64 if device == "cpu" else None

    def check(t: torch.Tensor) -> None:
        b = with_exotic(batch, at, t)
        try:
            want = helpers.reference_move(b, device, dtype)
        except Exception as err:  # a strided nested tensor has no copy to meta: the move names its path
            with pytest.raises(type(err), match=r"Cannot move \['exotic'\]"):
                todevice.move(b, device, dtype=dtype, coalesce=True)
            return
        got = todevice.move(b, device, dtype=dtype, coalesce=True)
        assert list(got) == list(want)
        for k in want:
            assert (got[k].device, got[k].dtype, got[k].layout) == (want[k].device, want[k].dtype, want[k].layout), k
            if device == "cpu" and k != "exotic":
                assert torch.equal(got[k], want[k]), k

    under(kind, check)


@given(batches_with(), st.sampled_from(KINDS), st.booleans())
@settings(max_examples=60)
def test_out_refuses_it_naming_its_path_before_writing_anything(
    case: tuple[dict[str, Any], int], kind: str, one_buffer: bool
) -> None:
    batch, at = case
    static = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in with_exotic(batch, at, torch.zeros(4)).items()}
    if one_buffer:  # views of one host buffer, as coalescing lays them out on an accelerator
        static = helpers.one_buffer(static)

    def check(t: torch.Tensor) -> None:
        with pytest.raises(ValueError, match=r"^Cannot copy into out: at \['exotic'\], the batch holds a "):
            todevice.move(with_exotic(batch, at, t), out=static)
        assert not any(v.any() for v in static.values())

    under(kind, check)


@pytest.mark.parametrize("kind", KINDS)
def test_every_path_moves_it(kind: str) -> None:
    """The default walk, coalescing and pack each move it: copied by itself, met twice and copied once."""

    def check(t: torch.Tensor) -> None:
        b = {"x": torch.ones(2), "t": t, "more": [torch.zeros(3), t]}
        for got in (
            todevice.move(b, "cpu", dtype=torch.float64),
            todevice.move(b, "cpu", dtype=torch.float64, coalesce=True),
            todevice.move(todevice.pack(b), "cpu", dtype=torch.float64),
        ):
            assert got["t"].dtype == torch.float64 and got["more"][1] is got["t"]
            assert got["t"].layout == t.layout and got["x"].dtype == torch.float64

    under(kind, check)
