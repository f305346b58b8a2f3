"""Values across a real device boundary, through the coalesced path, on the ``tdtest`` backend.

Runs only in a process of its own, started by tests/test_pack.py (``TODEVICE_TDTEST=1``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given

import todevice
from tests import helpers, strategies
from tests.backend import tdtest

DEV = torch.device("tdtest", 0)


def there_and_back(tree: Any, **kwargs: Any) -> tuple[Any, Any]:
    with torch.inference_mode():
        there = todevice.move(tree, "tdtest", **kwargs)
        back = todevice.move(there, "cpu", non_blocking=False)
    return there, back


def test_small_leaves_cross_in_one_copy() -> None:
    tree = {
        "x": [torch.randn(4) for _ in range(100)],
        "mask": torch.ones(3, 5, dtype=torch.bool),
        "ids": torch.arange(7),
        "half": torch.randn(2, 2).to(torch.bfloat16),
        "z": torch.randn(3, dtype=torch.complex64),
        "name": "batch-0",
    }
    before = dict(tdtest.COPIES)
    with torch.inference_mode():
        there = todevice.move(tree, "tdtest")
    assert tdtest.COPIES["h2d"] - before["h2d"] == 1  # 104 tensors, one copy
    assert there["x"][0].device == DEV and there["name"] == "batch-0"
    with torch.inference_mode():
        back = todevice.move(there, "cpu", non_blocking=False)
    helpers.assert_same_tree(back, tree, values=True)


def test_without_coalescing_each_leaf_is_a_copy() -> None:
    tree = [torch.randn(4) for _ in range(10)]
    before = tdtest.COPIES["h2d"]
    with torch.inference_mode():
        todevice.move(tree, "tdtest", coalesce=False)
    assert tdtest.COPIES["h2d"] - before == 10


def test_a_tensor_met_twice_crosses_once() -> None:
    t = torch.randn(4)
    tree = {"a": t, "b": [t], "tied": t.view(4), "other": torch.randn(4)}
    before = tdtest.COPIES["h2d"]
    with torch.inference_mode():
        there = todevice.move(tree, "tdtest", coalesce=False)
        back = todevice.move(there, "cpu", non_blocking=False)
    assert tdtest.COPIES["h2d"] - before == 2  # t once (its tied view shares the copy), "other" once
    assert there["a"] is there["b"][0] and there["tied"] is not there["a"]
    helpers.assert_same_tree(back, tree, values=True)


def test_large_leaves_travel_alone() -> None:
    big = torch.randn(1024)  # 4 KiB, over the threshold given below
    tree = {"big": big, "small": [torch.randn(2) for _ in range(5)]}
    before = tdtest.COPIES["h2d"]
    _, back = there_and_back(tree, coalesce_max_bytes=1024)
    assert tdtest.COPIES["h2d"] - before == 2  # the small ones together, the big one alone
    helpers.assert_same_tree(back, tree, values=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_dtype_cast_on_either_side(dtype: torch.dtype) -> None:
    tree = {"f": [torch.randn(3) for _ in range(4)], "i": torch.arange(3)}
    _, back = there_and_back(tree, dtype=dtype)
    expected = helpers.reference_move(tree, "cpu", dtype)
    helpers.assert_same_tree(back, expected, values=True)


def test_packed_batch_unpacks_on_the_device() -> None:
    tree = {"x": [torch.randn(3) for _ in range(6)], "y": torch.arange(4), "s": "label"}
    packed = todevice.pack(tree)
    before = tdtest.COPIES["h2d"]
    with torch.inference_mode():
        there = packed.unpack("tdtest")
        back = todevice.move(there, "cpu", non_blocking=False)
    assert tdtest.COPIES["h2d"] - before == 1
    helpers.assert_same_tree(back, tree, values=True)


@given(strategies.trees)
def test_random_trees_round_trip(tree: Any) -> None:
    _, back = there_and_back(tree)
    expected = helpers.reference_move(tree, "cpu")
    # requires_grad does not survive inference mode; values, types and structure do.
    helpers.assert_same_tree(back, expected, values=True, grad=False)
