"""move(batch, out=static): copies into a structure that stays, checked before anything is written."""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections import namedtuple
from typing import Any

import pytest
import torch
from hypothesis import given, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import todevice
from tests import helpers
from todevice import _into, _layout, _walk


def batch(seed: int, n: int = 100) -> dict[str, Any]:
    """A step's inputs: small tensors of mixed dtypes and shapes, a large one, and values that are not tensors."""
    g = torch.Generator().manual_seed(seed)
    return {
        "x": [torch.randn(3, generator=g) for _ in range(n)],
        "ids": torch.randint(0, 9, (7,), generator=g),
        "mask": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.randn((), generator=g),
        "half": torch.randn(2, 3, generator=g).half(),
        "image": torch.randn(3, 64, 64, generator=g),  # 48 KiB: under the coalescing limit
        "big": torch.randn(40_000, generator=g),  # 160 KiB: over it, its own allocation
        "name": f"step-{seed}",
    }


def leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree`` in walk order."""
    return _walk.pairs(tree, tree)[0]


class Copies(TorchDispatchMode):
    """The copies into tensors on ``device``, as the dispatcher sees them: (op, number of targets)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name.startswith("aten.copy_") and args[0].device.type == self.device:
            self.seen.append((name, 1))
        elif name.startswith("aten._foreach_copy_") and args[0] and args[0][0].device.type == self.device:
            self.seen.append((name, len(args[0])))
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- what comes back


def test_out_itself_comes_back_its_tensors_holding_the_batch_s_values() -> None:
    static = todevice.move(batch(0), "cpu")
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in static.items()}
    static["x"] = [t.clone() for t in static["x"]]
    before = {id(t): t.data_ptr() for t in leaves(static)}
    for step in (1, 2, 3):
        b = batch(step)
        got = todevice.move(b, out=static)
        assert got is static
        assert {id(t): t.data_ptr() for t in leaves(static)} == before  # the same tensors, the same memory
        helpers.assert_same_tree(
            {k: v for k, v in static.items() if k != "name"},
            {k: v for k, v in b.items() if k != "name"},
            values=True,
            same=False,
        )
        assert static["name"] == "step-0"  # values that are not tensors stay as out holds them


@pytest.mark.parametrize("coalesce", [True, False])
def test_into_one_host_buffer_laid_out_as_coalescing_lays_it_out(coalesce: bool) -> None:
    """The buffer that a coalesced move returns: each tensor lands at its place in it, none elsewhere."""
    static = todevice.move(batch(0), "meta", coalesce=True)  # the layout of a coalesced move...
    small = [t for t in leaves(static) if t.nbytes <= todevice.COALESCE_MAX_BYTES]
    lay = _layout.layout(tuple(t.dtype for t in small), tuple(t.shape for t in small), None)
    assert _into._span(small, lay) is not None  # ...which out= recognises
    host = torch.full((lay.nbytes,), 0xAB, dtype=torch.uint8)  # ...and the same layout in host memory
    views = _layout.read(host, lay)
    host_static = batch(0)
    it = iter(views)
    host_static["x"] = [next(it) for _ in host_static["x"]]
    for k in ("ids", "mask", "scalar", "half", "image"):
        host_static[k] = next(it)
    host_static["big"] = torch.zeros(40_000)
    b = batch(5)
    todevice.move(b, out=host_static, coalesce=coalesce)
    for k in ("ids", "mask", "scalar", "half", "image", "big"):
        assert torch.equal(host_static[k], b[k]), k
    assert all(torch.equal(a, e) for a, e in zip(host_static["x"], b["x"]))
    # The padding between the tensors is left as it was.
    written = torch.zeros(lay.nbytes, dtype=torch.bool)
    for v in views:
        start = v.storage_offset() * v.element_size()
        written[start : start + v.nbytes] = True
    assert bool((host[~written] == 0xAB).all())


def test_one_copy_when_the_targets_are_one_device_buffer_without_padding() -> None:
    tight = {"x": [torch.randn(4) for _ in range(50)], "ids": torch.arange(8), "big": torch.randn(40_000)}
    static = todevice.move(tight, "meta", coalesce=True)
    with Copies("meta") as copies:
        todevice.move(tight, out=static)
    # The small tensors in one copy of the staging buffer (16 and 64 bytes each: no padding); the large one alone.
    assert sorted(copies.seen) == [("aten.copy_.default", 1), ("aten.copy_.default", 1)]


def test_a_copy_per_group_where_the_padding_between_the_targets_may_be_another_tensor_s() -> None:
    static = todevice.move(batch(0), "meta", coalesce=True)  # float32[3] and others: padded to 16 bytes each
    small = [t for t in leaves(static) if t.nbytes <= todevice.COALESCE_MAX_BYTES]
    groups = _layout.layout_for(small, None).groups
    with Copies("meta") as copies:
        todevice.move(batch(1), out=static)
    blocks = [("aten.copy_.default", 1)] * sum(type(g) is _layout.Block for g in groups)
    ragged = [("aten._foreach_copy_.default", len(g.shapes)) for g in groups if type(g) is _layout.Ragged]
    assert sorted(copies.seen) == sorted([*blocks, *ragged, ("aten.copy_.default", 1)])  # and the large one alone
    with Copies("meta") as copies:  # part of that buffer: one block of it
        todevice.move({"x": batch(1)["x"]}, out={"x": static["x"]})
    assert copies.seen == [("aten.copy_.default", 1)]


def test_the_columns_beside_targets_that_are_part_of_a_larger_tensor_are_never_written() -> None:
    big = torch.arange(8.0).view(2, 4)
    static = {"a": big[0, :3], "b": big[1, :3]}  # laid out as coalescing lays them out, 4 bytes of padding each
    todevice.move({"a": torch.zeros(3), "b": torch.ones(3)}, out=static)
    assert big.tolist() == [[0.0, 0.0, 0.0, 3.0], [1.0, 1.0, 1.0, 7.0]]


def test_a_copy_each_when_the_targets_are_not_one_buffer() -> None:
    static = todevice.move(batch(0), "meta", coalesce=False)
    with Copies("meta") as copies:
        todevice.move(batch(1), out=static)
    assert ("aten._foreach_copy_.default", 105) in copies.seen  # the small ones, cut from one staging buffer
    with Copies("meta") as copies:
        todevice.move(batch(1), out=todevice.move(batch(0), "meta", coalesce=True), coalesce=False)
    assert ("aten._foreach_copy_.default", 105) in copies.seen  # coalesce=False: never the one copy


def test_the_device_may_be_named_and_must_then_hold_out() -> None:
    static = todevice.move(batch(0), "meta", coalesce=True)
    assert todevice.move(batch(1), "meta", out=static) is static
    with pytest.raises(ValueError, match=r"at \['ids'\], out's tensor is on cpu, not on meta"):
        todevice.move(batch(1), "meta", out={**static, "ids": torch.zeros(7, dtype=torch.int64)})


def test_a_cast_on_the_way_in() -> None:
    b = {"f": torch.randn(3), "i": torch.arange(3)}
    static = {"f": torch.zeros(3, dtype=torch.float16), "i": torch.zeros(3, dtype=torch.int64)}
    todevice.move(b, out=static, dtype=torch.float16)
    assert torch.equal(static["f"], b["f"].half()) and torch.equal(static["i"], b["i"])
    with pytest.raises(ValueError, match=r"at \['f'\], out's tensor is torch.float32 and the batch's is torch.float16"):
        todevice.move(b, out={"f": torch.zeros(3), "i": torch.zeros(3, dtype=torch.int64)}, dtype=torch.float16)


@dataclasses.dataclass
class Inputs:
    tokens: torch.Tensor
    lengths: list[int]
    extra: dict[str, torch.Tensor]


Pair = namedtuple("Pair", "a b")


def test_dataclasses_namedtuples_tuples_and_bare_tensors() -> None:
    def make(seed: int) -> Any:
        g = torch.Generator().manual_seed(seed)
        return (
            Inputs(torch.randint(0, 9, (4,), generator=g), [1, 2], {"e": torch.randn(2, generator=g)}),
            Pair(torch.randn(2, generator=g), None),
        )

    static = make(0)
    b = make(1)
    todevice.move(b, out=static)
    helpers.assert_same_tree(static, b, values=True, same=False)
    t = torch.zeros(3)
    assert todevice.move(torch.ones(3), out=t) is t and torch.equal(t, torch.ones(3))


def test_skip_keys_are_neither_paired_nor_copied() -> None:
    static = {"x": torch.zeros(2), "lengths": torch.zeros(3)}
    todevice.move({"x": torch.ones(2), "lengths": torch.ones(5)}, out=static, skip_keys="lengths")
    assert torch.equal(static["x"], torch.ones(2)) and torch.equal(static["lengths"], torch.zeros(3))
    todevice.move({"x": torch.ones(2)}, out=static, skip_keys="lengths")  # absent on one side: fine too


# ---------------------------------------------------------------- errors: checked first, nothing written


def mismatches() -> list[tuple[str, Any, str]]:
    good = {"a": torch.ones(2), "b": [torch.ones(3), torch.ones(1, dtype=torch.int64)]}
    return [
        (
            "shape",
            {**good, "b": [torch.ones(3), torch.ones(2, dtype=torch.int64)]},
            r"at \['b'\]\[1\], out's tensor has shape \(1,\) and the batch's \(2,\)",
        ),
        (
            "dtype",
            {**good, "b": [torch.ones(3), torch.ones(1)]},
            r"at \['b'\]\[1\], out's tensor is torch.int64 and the batch's is torch.float32",
        ),
        ("length", {**good, "b": [torch.ones(3)]}, r"at \['b'\], out holds 2 items where the batch has 1"),
        (
            "keys",
            {"a": torch.ones(2), "c": good["b"]},
            r"at the top level, the keys differ: the batch has \['c'\] that out has not, and out has \['b'\]",
        ),
        (
            "container",
            {**good, "b": (torch.ones(3), torch.ones(1, dtype=torch.int64))},
            r"at \['b'\], out holds a list where the batch has a tuple",
        ),
        (
            "not a tensor in out",
            {**good, "b": [torch.ones(3), 7]},
            r"at \['b'\]\[1\], out holds Tensor of shape \(1,\), torch.int64, on cpu where the batch has int",
        ),
        (
            "grad",
            {**good, "b": [torch.ones(3), torch.ones(1, dtype=torch.int64)], "a": torch.ones(2, requires_grad=True)},
            r"at \['a'\], the batch's tensor requires grad",
        ),
        (
            "meta",
            {**good, "b": [torch.ones(3, device="meta"), torch.ones(1, dtype=torch.int64)]},
            r"at \['b'\]\[0\], the batch holds a Tensor of shape \(3,\), torch.float32, on meta",
        ),
    ]


@pytest.mark.parametrize("name,bad,message", mismatches(), ids=[m[0] for m in mismatches()])
def test_a_mismatch_names_its_path_and_nothing_is_written(name: str, bad: Any, message: str) -> None:
    static = {"a": torch.zeros(2), "b": [torch.zeros(3), torch.zeros(1, dtype=torch.int64)]}
    with pytest.raises(ValueError, match=message + r".* Nothing was copied\."):
        todevice.move(bad, out=static)
    assert all(not t.any() for t in leaves(static))  # "a" comes first and would have matched: still zeros


def test_one_target_for_two_different_sources_is_refused() -> None:
    t = torch.zeros(2)
    with pytest.raises(ValueError, match=r"at \['a'\], out holds this very tensor at two places"):
        todevice.move({"a": torch.ones(2), "b": torch.full((2,), 2.0)}, out={"a": t, "b": t})
    shared = torch.ones(2)
    todevice.move({"a": shared, "b": shared}, out={"a": t, "b": t})  # the same source twice: fine
    assert torch.equal(t, shared)


def test_objects_whose_tensors_cannot_be_paired_are_refused() -> None:
    class Encoding(dict):  # type: ignore[type-arg]
        def to(self, device: Any) -> Encoding:
            return Encoding({k: v.to(device) for k, v in self.items()})

    with pytest.raises(ValueError, match=r"at \['enc'\], the batch holds .*Encoding, an object with its own .to\(\)"):
        todevice.move({"enc": Encoding(x=torch.ones(2))}, out={"enc": Encoding(x=torch.zeros(2))})
    packed = todevice.pack({"x": torch.ones(2)})
    with pytest.raises(ValueError, match="a PackedBatch"):
        todevice.move(packed, out={"x": torch.zeros(2)})


def test_a_host_stream_is_ignored_a_bad_one_refused_and_device_is_needed_without_out() -> None:
    static = {"a": torch.zeros(2)}
    for device in (None, "cpu"):  # the host has no streams: a host stream orders nothing, as on every path to the host
        assert todevice.move({"a": torch.ones(2)}, device, out=static, stream=torch.Stream(device="cpu")) is static
        assert torch.equal(static["a"], torch.ones(2))
        static["a"].zero_()
    with pytest.raises(TypeError, match=r"stream takes a torch\.Stream"):  # not a stream: the rule every path checks
        todevice.move({"a": torch.ones(2)}, out={"a": torch.zeros(2)}, stream=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Cannot move to device None"):
        todevice.move({"a": torch.ones(2)})


# ---------------------------------------------------------------- any structure


DTYPES = [torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8, torch.float64]
shapes = st.lists(st.integers(0, 4), max_size=2).map(tuple)


@given(
    st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=30), st.booleans(), st.integers(0, 256)
)
def test_random_batches_land_in_separate_and_in_coalesced_buffers(
    signature: list[tuple[tuple[int, ...], torch.dtype]], coalesce: bool, limit: int
) -> None:
    def make(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {f"t{i}": (torch.rand(shape, generator=g) * 10).to(dtype) for i, (shape, dtype) in enumerate(signature)}

    separate = make(0)
    coalesced = todevice.pack(make(0)).unpack()  # views of one host buffer, laid out as coalescing does
    b = make(1)
    for target in (separate, coalesced):
        todevice.move(b, out=target, coalesce=coalesce, coalesce_max_bytes=limit)
        for k in b:
            assert torch.equal(target[k], b[k]), k


def test_a_sparse_source_is_refused_before_anything_is_written() -> None:
    static = {"b": torch.zeros(2), "a": torch.zeros(3, 3)}
    with pytest.raises(
        ValueError, match=r"at \['a'\], the batch holds a Tensor of shape \(3, 3\).* Nothing was copied"
    ):
        todevice.move({"b": torch.ones(2), "a": torch.eye(3).to_sparse()}, out=static)
    assert not static["b"].any()


EXOTIC = ["sparse_csr", "sparse_coo", "nested", "jagged"]  # helpers.exotic's kinds


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("one_buffer", [True, False], ids=["one-buffer", "separate"])
@pytest.mark.parametrize("kind", EXOTIC)
def test_a_sparse_or_nested_source_gets_out_s_error_naming_its_path_before_any_write(
    kind: str, one_buffer: bool
) -> None:
    """out='s ValueError with its path, whatever the targets are, and no target written: not torch's own error from
    the copy (a CSR tensor has bytes but no data pointer; a strided nested one has no shape)."""
    example = {"x1": torch.ones(16), "big": torch.ones(40_000), "x2": torch.ones(4, 4), "x3": torch.ones(2)}
    static = helpers.one_buffer(example) if one_buffer else {k: torch.zeros_like(v) for k, v in example.items()}
    b = dict(example, x2=helpers.exotic(kind))
    with pytest.raises(ValueError, match=r"^Cannot copy into out: at \['x2'\], the batch holds a .*Nothing was copied"):
        todevice.move(b, out=static)
    assert not any(t.any() for t in static.values())


@pytest.mark.parametrize("one_buffer", [True, False], ids=["one-buffer", "separate"])
def test_a_source_wrapped_by_vmap_gets_out_s_error_and_a_plain_one_is_copied_under_vmap(one_buffer: bool) -> None:
    """Inside torch.func.vmap the function's inputs are wrappers with no memory of their own, which out= cannot copy
    (in place, a batched value does not fit an unbatched target): out='s ValueError with the path. A tensor made
    outside the transform is an ordinary one, copied as anywhere."""
    example = {"x1": torch.ones(16), "x2": torch.ones(4)}
    static = helpers.one_buffer(example) if one_buffer else {k: torch.zeros_like(v) for k, v in example.items()}

    def step(x: torch.Tensor) -> torch.Tensor:
        with pytest.raises(ValueError, match=r"at \['x2'\], the batch holds a Tensor .*wrapped by torch\.func"):
            todevice.move(dict(example, x2=x), out=static)
        assert not any(t.any() for t in static.values())
        todevice.move(dict(example, x2=torch.full((4,), 2.0)), out=static)
        return x

    torch.func.vmap(step)(torch.ones(3, 4))
    assert torch.equal(static["x2"], torch.full((4,), 2.0)) and torch.equal(static["x1"], torch.ones(16))


def test_under_torch_compile_the_copies_run_between_two_graphs() -> None:
    static = {"a": torch.zeros(3), "b": [torch.zeros(2, dtype=torch.int64)]}

    @torch.compile(backend="eager")
    def step(batch: dict[str, Any]) -> torch.Tensor:
        todevice.move(batch, out=static)
        return static["a"] * 2

    for k in (1, 2):
        got = step({"a": torch.full((3,), float(k)), "b": [torch.full((2,), k)]})
        assert torch.equal(got, torch.full((3,), 2.0 * k)) and torch.equal(static["b"][0], torch.full((2,), k))
    with pytest.raises(ValueError, match=r"at \['a'\], out's tensor has shape \(3,\)"):
        step({"a": torch.ones(4), "b": [torch.ones(2, dtype=torch.int64)]})


def test_targets_copy_cannot_write_are_refused_before_anything_is_written() -> None:
    with torch.inference_mode():
        frozen = torch.zeros(2)
    for bad in (torch.zeros(1).expand(3), torch.zeros(3).to_sparse(), frozen):
        static = {"a": torch.zeros(2), "b": bad}
        with pytest.raises(ValueError, match=r"at \['b'\], out's tensor .* cannot be written in place"):
            todevice.move({"a": torch.ones(2), "b": torch.ones(bad.shape)}, out=static)
        assert not static["a"].any()


def test_a_step_of_large_tensors_only_copies_each_alone() -> None:
    static = {"a": torch.zeros(40_000), "b": [torch.zeros(20_000, dtype=torch.float64)]}
    b = {"a": torch.randn(40_000), "b": [torch.randn(20_000, dtype=torch.float64)]}
    assert todevice.move(b, out=static, coalesce_max_bytes=1024) is static
    assert torch.equal(static["a"], b["a"]) and torch.equal(static["b"][0], b["b"][0])


def test_one_buffer_of_inference_tensors_is_written_in_inference_mode_only() -> None:
    with torch.inference_mode():
        static = helpers.one_buffer(flat_inputs(0))
    before = {k: v.clone() for k, v in static.items()}
    with pytest.raises(ValueError, match=r"cannot be written in place"):
        todevice.move(flat_inputs(1), out=static)
    assert all(torch.equal(static[k], before[k]) for k in static)  # nothing written
    with torch.inference_mode():
        b = flat_inputs(2)
        todevice.move(b, out=static)
    assert all(torch.equal(static[k], b[k]) for k in static)


def test_conjugate_and_negative_views_get_their_values_not_their_bytes() -> None:
    buffer = todevice.pack({"z": torch.zeros(2, dtype=torch.complex64), "n": torch.zeros(4)}).unpack()
    static = {"z": buffer["z"].conj(), "n": buffer["n"]._neg_view()}
    b = {"z": torch.tensor([3 + 3j, 4 + 4j], dtype=torch.complex64), "n": torch.full((4,), 2.0)}
    todevice.move(b, out=static)
    assert torch.equal(static["z"], b["z"]) and torch.equal(static["n"], b["n"])


def test_sets_are_refused_and_skipped_keys_may_be_absent_from_any_mapping() -> None:
    with pytest.raises(ValueError, match="a set, whose items have no order"):
        todevice.move({"s": {torch.ones(1)}}, out={"s": {torch.zeros(1)}})
    static = collections.OrderedDict(x=torch.zeros(2))
    todevice.move(collections.OrderedDict(x=torch.ones(2), lengths=torch.ones(3)), out=static, skip_keys="lengths")
    assert torch.equal(static["x"], torch.ones(2))


# ---------------------------------------------------------------- the same targets, step after step


def flat_inputs(seed: int) -> dict[str, torch.Tensor]:
    """100 small inputs, as a loop into static buffers copies them: 90 float32[16] and 10 int64[8]."""
    g = torch.Generator().manual_seed(seed)
    out = {f"x{i}": torch.randn(16, generator=g) for i in range(90)}
    out.update({f"ids{i}": torch.randint(0, 1000, (8,), generator=g) for i in range(10)})
    return out


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which of out='s checks run, in order: "one buffer" (the few reads of the common step) and "full"."""
    ran: list[str] = []
    for module, name, label in ((_into, "step_for", "one buffer"), (_into, "_check_pairs", "full")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, real=real, label=label: ran.append(label) or real(*args))
    return ran


def test_every_step_checks_every_pair_whatever_ran_before(checks: list[str]) -> None:
    static = helpers.one_buffer(flat_inputs(0))
    for step in range(1, 6):
        b = flat_inputs(step)
        assert todevice.move(b, out=static) is static
        assert all(torch.equal(static[k], b[k]) for k in b)
    assert checks == ["one buffer"] * 5  # nothing is remembered of the targets: each step reads every pair


def test_a_step_into_part_of_a_buffer_right_after_one_into_all_of_it_writes_that_part_alone() -> None:
    """Nothing is kept between steps, and a copy writes the targets' bytes, never the padding between them."""
    example = {f"x{i}": torch.randn(3) for i in range(20)}  # 12 bytes each, padded to 16
    static = helpers.one_buffer(example)
    for _ in range(2):
        b = {k: torch.randn(3) for k in example}
        todevice.move(b, out=static)
        assert all(torch.equal(static[k], b[k]) for k in b)
        kept = {k: v.clone() for k, v in static.items()}
        part = {k: torch.randn(3) for k in list(example)[5:10]}
        todevice.move(part, out={k: static[k] for k in part})
        assert all(torch.equal(static[k], part[k] if k in part else kept[k]) for k in static)


def test_a_changed_target_is_found_on_the_next_step() -> None:
    static = helpers.one_buffer(flat_inputs(0))
    todevice.move(flat_inputs(1), out=static)
    static["x3"] = torch.zeros(16)  # another tensor at this key: another set of targets
    b = flat_inputs(2)
    todevice.move(b, out=static)
    assert torch.equal(static["x3"], b["x3"]) and torch.equal(static["x4"], b["x4"])
    static["x3"].resize_(8)  # the same tensor, another shape: found out, and nothing written
    kept = {k: v.clone() for k, v in static.items()}
    with pytest.raises(ValueError, match=r"at \['x3'\], out's tensor has shape \(8,\) and the batch's \(16,\)"):
        todevice.move(flat_inputs(3), out=static)
    assert all(torch.equal(static[k], kept[k]) for k in static)
    static["x3"].set_(torch.zeros(16))  # the same tensor over other memory: its own copy
    b = flat_inputs(4)
    todevice.move(b, out=static)
    assert all(torch.equal(static[k], b[k]) for k in b)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda b: b.update(x5=torch.randn(4)), r"at \['x5'\], out's tensor has shape \(16,\) and the batch's \(4,\)"),
        (
            lambda b: b.update(ids2=torch.zeros(8)),
            r"at \['ids2'\], out's tensor is torch.int64 and the batch's is torch.float32",
        ),
        (lambda b: b.update(x7=torch.randn(16, requires_grad=True)), r"at \['x7'\], the batch's tensor requires grad"),
        (
            lambda b: b.update(x9=torch.randn(16).to_sparse()),
            r"at \['x9'\], the batch holds a Tensor .*dense tensors with data only",
        ),
    ],
)
def test_sources_are_checked_every_step_and_a_bad_one_writes_nothing(
    checks: list[str], change: Any, error: str
) -> None:
    static = helpers.one_buffer(flat_inputs(0))
    todevice.move(flat_inputs(1), out=static)
    kept = {k: v.clone() for k, v in static.items()}
    b = flat_inputs(2)
    change(b)
    with pytest.raises(ValueError, match=error):
        todevice.move(b, out=static)
    assert all(torch.equal(static[k], kept[k]) for k in static)
    # Each step reads every pair: the bad one fails the few reads, and the full check names it before any write.
    assert checks == ["one buffer", "one buffer", "full"]


def test_a_target_freed_and_its_id_taken_by_another_tensor_is_written_right() -> None:
    for step in range(4):  # new static buffers each time: ids may come back, and nothing is kept by id
        static = (
            helpers.one_buffer(flat_inputs(0))
            if step % 2
            else {k: torch.zeros_like(v) for k, v in flat_inputs(0).items()}
        )
        b = flat_inputs(step)
        todevice.move(b, out=static)
        assert all(torch.equal(static[k], b[k]) for k in b)
        del static


def test_skip_keys_never_hides_a_key_that_only_out_has() -> None:
    static = {"x": torch.zeros(3), "y": torch.zeros(2)}
    batch = {"x": torch.ones(3), "lengths": torch.tensor([3])}
    with pytest.raises(ValueError, match=r"the batch has \[\] that out has not, and out has \['y'\]"):
        todevice.move(batch, out=static, skip_keys="lengths")
    assert torch.equal(static["x"], torch.zeros(3))  # nothing written
    both = {"x": torch.zeros(3), "lengths": torch.tensor([0])}
    assert todevice.move(batch, out=both, skip_keys="lengths") is both
    assert torch.equal(both["x"], torch.ones(3)) and both["lengths"].item() == 0  # skipped: left as out holds it
    assert todevice.move(batch, out={"x": both["x"]}, skip_keys="lengths")["x"] is both["x"]  # on one side only


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "one-buffer"])
def test_a_swap_and_a_rolling_buffer_copy_as_if_every_source_were_read_first(packed: bool) -> None:
    def static_of(*values: float) -> list[torch.Tensor]:
        if packed:  # views of one buffer, as a coalesced move lays them out
            lay = _layout.layout_for([torch.zeros(4)] * len(values), None)
            views = _layout.read(torch.zeros(lay.nbytes, dtype=torch.uint8), lay)
        else:
            views = [torch.zeros(4) for _ in values]
        for v, x in zip(views, values):
            v.fill_(x)
        return views

    x, y = static_of(1.0, 2.0)
    todevice.move({"a": y, "b": x}, out={"a": x, "b": y})  # a swap
    assert x.tolist() == [2.0] * 4 and y.tolist() == [1.0] * 4
    h0, h1, h2 = static_of(0.0, 1.0, 2.0)
    new = torch.full((4,), 3.0)
    todevice.move([h1, h2, new], out=[h0, h1, h2])  # a rolling history: each slot takes the next one's values
    assert [h.tolist()[0] for h in (h0, h1, h2)] == [1.0, 2.0, 3.0]


def test_a_source_over_part_of_its_own_target_is_read_first() -> None:
    w = torch.arange(8.0)
    todevice.move({"a": w[1:5]}, out={"a": w[0:4]})
    assert w.tolist() == [1.0, 2.0, 3.0, 4.0, 4.0, 5.0, 6.0, 7.0]


@pytest.mark.parametrize(
    "make",
    [lambda buf: (buf[0:4], buf[2:6]), lambda buf: (buf[0:8].view(2, 4), buf[4:8])],
    ids=["slices", "tensor-and-row"],
)
def test_targets_that_share_memory_are_refused_before_anything_is_written(make: Any) -> None:
    buf = torch.zeros(8)
    first, second = make(buf)
    batch = {"p": torch.ones_like(first), "q": torch.full_like(second, 2.0)}
    with pytest.raises(ValueError, match=r"at \['q'\], out's tensor shares memory with the one at \['p'\]"):
        todevice.move(batch, out={"p": first, "q": second})
    assert buf.tolist() == [0.0] * 8


class _Ghost(collections.abc.Mapping):  # type: ignore[type-arg]
    """A mapping whose iteration names a key it does not hold."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Any:
        return iter([*self._items, "ghost"])

    def __len__(self) -> int:
        return len(self._items) + 1


@pytest.mark.parametrize("options", [{"out": "static"}, {"strict": True}], ids=["out", "strict"])
def test_a_container_that_cannot_list_its_items_fails_with_its_own_error_and_path(options: dict[str, Any]) -> None:
    batch = {"ok": torch.ones(2), "m": [_Ghost({"x": torch.ones(2)})]}
    static = {"ok": torch.zeros(2), "m": [_Ghost({"x": torch.zeros(2)})]}
    kwargs = {"out": static} if "out" in options else {"strict": True}
    with pytest.raises(KeyError, match=r"\['m'\]\[0\] \(_Ghost\).*'ghost'"):
        todevice.move(batch, "cpu" if "strict" in kwargs else None, **kwargs)
    assert torch.equal(static["ok"], torch.zeros(2))  # nothing written


def test_a_source_at_two_places_over_a_target_is_read_first_at_both() -> None:
    x, y, z = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([0.0])
    todevice.move({"a": y, "b": x, "c": x}, out={"a": x, "b": y, "c": z})
    assert (x.item(), y.item(), z.item()) == (2.0, 1.0, 1.0)


def test_interleaved_targets_over_one_buffer_are_not_refused() -> None:
    m = torch.zeros(3, 2)
    todevice.move({"u": torch.ones(3), "v": torch.full((3,), 2.0)}, out={"u": m[:, 0], "v": m[:, 1]})
    assert m.tolist() == [[1.0, 2.0]] * 3
    with pytest.raises(ValueError, match="shares memory"):  # a column and a row that cross do share an element
        todevice.move({"u": torch.ones(3), "v": torch.ones(2)}, out={"u": m[:, 0], "v": m[0]})


def test_a_one_element_target_of_any_stride_is_written() -> None:
    """A one-element view is contiguous whatever its stride: its bytes are reached without a view that needs one, and
    the large tensor copied before them is not left written alone."""
    grid, big = torch.zeros(4, 4), torch.zeros(20000)
    for step in range(2):  # checked, then verified
        value = 7.0 + step
        out = todevice.move({"a": torch.tensor([value]), "big": torch.ones(20000)}, out={"a": grid[:1, 0], "big": big})
        assert out["a"].item() == value and grid[0, 0] == value and grid.sum() == value and big.sum() == 20000
    todevice.move({"a": torch.tensor([3.0])}, out={"a": grid[:1, 0]})
    assert grid[0, 0] == 3.0
    row = torch.zeros(8)
    todevice.move({"a": torch.tensor([1.0]), "b": torch.tensor([2.0])}, out={"a": row[0:1], "b": row[4:5]})
    assert row.tolist() == [1.0, 0, 0, 0, 2.0, 0, 0, 0]


# ---------------------------------------------------------------- pairing by the walk's rule


@dataclasses.dataclass
class Rec:
    a: Any
    b: Any


@given(
    st.dictionaries(st.text("abcdef", min_size=1, max_size=2), st.integers(0, 3), max_size=6),
    st.randoms(use_true_random=False),
    st.booleans(),
)
def test_the_flat_case_pairs_as_the_walk_s_rule_pairs(shape: dict[str, int], rnd: Any, drop: bool) -> None:
    """``_flat_pairs`` specialises the pairing of two dicts of tensors: where it answers, it gives what ``pairs``
    gives; keys in another order in out are paired by key, and a key missing from out is named by ``pairs``."""
    pool = [torch.full((2,), float(i)) for i in range(4)]
    batch = {k: pool[i] for k, i in shape.items()}
    keys = list(batch)
    rnd.shuffle(keys)
    if drop and keys:
        keys.pop()
    out = {k: torch.zeros(2) for k in keys}
    flat = _walk._flat_pairs(batch, out)
    try:
        general = _walk.pairs(batch, out)
    except ValueError as err:
        assert flat is None and "keys differ" in str(err)
        return
    if flat is not None:
        assert [list(map(id, side)) for side in general] == [list(map(id, side)) for side in flat]


@pytest.mark.parametrize(
    ("batch", "out", "message"),
    [
        (
            {"a": {"x": torch.ones(1)}},
            {"a": {"y": torch.ones(1)}},
            r"at \['a'\], the keys differ: the batch has \['x'\]",
        ),
        (
            collections.OrderedDict(a=torch.ones(1), b=torch.ones(1)),
            collections.OrderedDict(b=torch.ones(1), c=torch.ones(1)),
            r"the keys differ: the batch has \['a'\] that out has not, and out has \['c'\]",
        ),
        (collections.deque([torch.ones(1)] * 2), collections.deque([torch.ones(1)]), r"out holds 1 items where"),
        (Rec(torch.ones(1), torch.ones(1)), Rec(torch.ones(1), None), r"at \.b, out holds None"),
    ],
)
def test_pairs_are_found_by_key_or_entry_and_a_difference_names_both_sides(batch: Any, out: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        todevice.move(batch, out=out)


def test_a_mapping_in_another_order_is_paired_by_key() -> None:
    batch = collections.OrderedDict(a=torch.ones(1), b=torch.full((2,), 2.0))
    out = collections.OrderedDict(b=torch.zeros(2), a=torch.zeros(1))
    assert todevice.move({"m": batch}, out={"m": out})["m"] is out
    assert torch.equal(out["a"], batch["a"]) and torch.equal(out["b"], batch["b"])


def test_a_dataclass_whose_attributes_differ_is_not_said_to_differ_in_keys() -> None:
    batch, out = Rec(torch.ones(1), torch.ones(1)), Rec(torch.zeros(1), torch.zeros(1))
    out.extra = torch.zeros(1)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"the batch has \[\] that out has not, and out has \['\.extra'\]") as err:
        todevice.move(batch, out=out)
    assert "keys" not in str(err.value)


def test_tensor_keys_pair_as_a_dict_finds_them() -> None:
    """Keys pair by hash and equality, as out[key] would find them: tensors by identity."""
    key, other = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])
    source = torch.ones(3)
    with pytest.raises(ValueError, match="the keys differ"):
        todevice.move({key: source}, out={other: torch.zeros(3)})
    for k in (torch.tensor(1.0), torch.tensor([1.0, 2.0])):  # equal values, other objects: refused, nothing written
        target = torch.zeros(3)
        with pytest.raises(ValueError, match="the keys differ"):
            todevice.move({"m": {k: source}}, out={"m": {k.clone(): target}})
        assert torch.equal(target, torch.zeros(3))
    out = {"m": {key: torch.zeros(3)}}
    todevice.move({"m": {key: source}}, out=out)
    assert torch.equal(out["m"][key], source)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("first", [True, False], ids=["first", "second"])
@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "nested"])
@pytest.mark.parametrize("max_bytes", [todevice.COALESCE_MAX_BYTES, 4])
def test_a_target_that_is_not_dense_gets_out_s_error_wherever_it_is(first: bool, kind: str, max_bytes: int) -> None:
    bad = helpers.exotic(kind)
    out = {"a": bad, "x": torch.zeros(3)} if first else {"x": torch.zeros(3), "a": bad}
    batch = {k: torch.ones(3) for k in out}
    with pytest.raises(ValueError, match=r"at \['a'\], out's tensor \(Tensor .*cannot be written in place"):
        todevice.move(batch, out=out, coalesce_max_bytes=max_bytes)


@pytest.mark.parametrize("dtype", [None, torch.float32], ids=["step", "cast"])
def test_every_target_of_one_buffer_is_marked_written_for_autograd(dtype: Any) -> None:
    """Tensors cut from one buffer each have a version counter of their own: a write through one view of the buffer
    moves every target's, so a tensor saved for a backward pass fails it, as with a copy_() into each."""
    static = todevice.static({"a": torch.zeros(3), "b": torch.ones(2)}, "cpu").static
    w = torch.ones(2, requires_grad=True)
    y = (w * static["b"]).sum()  # static["b"] saved for backward
    source = torch.float64 if dtype is not None else torch.float32  # cast on the way in: the other path
    todevice.move({"a": torch.full((3,), 7.0), "b": torch.full((2,), 5.0, dtype=source)}, out=static, dtype=dtype)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_an_inference_tensor_anywhere_among_the_targets_is_refused_outside_inference_mode() -> None:
    buf = torch.zeros(8)
    with torch.inference_mode():
        b = torch.empty(0).set_(buf.untyped_storage(), 4, (2,), (1,))  # the second target, over the same buffer
    with pytest.raises(ValueError, match=r"at \['b'\], out's tensor .*inference tensor outside torch.inference_mode"):
        todevice.move({"a": torch.ones(3), "b": torch.ones(2)}, out={"a": buf[0:3], "b": b})
    assert buf.eq(0).all()


def test_out_pairs_structures_nested_more_than_half_the_recursion_limit_deep() -> None:
    depth = sys.getrecursionlimit() * 3 // 5  # a frame a level: about half the limit took two frames a level

    def nested(t: torch.Tensor) -> Any:
        for _ in range(depth):
            t = [t]  # type: ignore[assignment]
        return t

    static = nested(torch.zeros(3))
    assert todevice.move(nested(torch.ones(3)), out=static) is static
    inner = static
    for _ in range(depth):
        inner = inner[0]
    assert torch.equal(inner, torch.ones(3))
    with pytest.raises(ValueError, match=r"out's tensor has shape \(3,\) and the batch's \(2,\)"):
        todevice.move(nested(torch.ones(2)), out=static)
