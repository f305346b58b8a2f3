"""Diagnostics with real mismatches between 'cpu' and 'meta' tensors."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import todevice
from tests import helpers

CPU, META = torch.device("cpu"), torch.device("meta")


def cpu(*shape: int) -> torch.Tensor:
    return torch.ones(*shape)


def meta(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, device="meta")


# ---------------------------------------------------------------- devices()


def test_devices_of_a_nested_structure() -> None:
    tree = {"x": [cpu(1), helpers.Record(meta(1), (cpu(2),))], "n": 3}
    assert todevice.devices(tree) == {"['x'][0]": CPU, "['x'][1].a": META, "['x'][1].b[0]": CPU}


def test_devices_of_a_module_by_qualified_name() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    found = todevice.devices(model)
    assert found["0.weight"] == CPU and found["1.running_mean"] == CPU and "1.num_batches_tracked" in found


def test_devices_of_a_module_inside_a_structure() -> None:
    found = todevice.devices({"model": nn.Linear(1, 1), "x": meta(1)})
    assert found == {"['model'].weight": CPU, "['model'].bias": CPU, "['x']": META}


class _NamesWithoutPrefix(nn.Linear):
    """A module whose named_parameters() drops its prefix= argument, as some overrides do."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        return super().named_parameters(recurse=recurse, remove_duplicate=remove_duplicate)


def test_a_module_s_tensors_are_named_by_their_path_whatever_its_named_parameters_does_with_prefix() -> None:
    found = todevice.devices({"m": _NamesWithoutPrefix(1, 1)})
    assert found == {"['m'].weight": CPU, "['m'].bias": CPU}


def test_devices_of_a_bare_tensor() -> None:
    assert todevice.devices(meta(2)) == {"": META}


# ---------------------------------------------------------------- check()


def test_check_returns_the_shared_device() -> None:
    assert todevice.check({"a": cpu(1)}, [cpu(2)], nn.Linear(1, 1)) == CPU
    assert todevice.check({"a": 1}) is None
    assert todevice.check(meta(1), device="meta") == META


def test_check_names_every_device_and_its_paths() -> None:
    model = nn.Linear(2, 2)
    batch = {"x": cpu(2), "y": meta(2)}
    with pytest.raises(todevice.DeviceMismatchError) as info:
        todevice.check(model, batch)
    assert str(info.value) == (
        "Expected every tensor on one device, found 2: cpu: objs[0].weight, objs[0].bias, objs[1]['x']; "
        "meta: objs[1]['y']. Move them with todevice.move(obj, device), or module.to(device)."
    )
    assert isinstance(info.value, RuntimeError)


def test_check_against_a_device_lists_everything_elsewhere() -> None:
    tree = {"ok": meta(1), "bad": [cpu(1), cpu(1)]}
    with pytest.raises(todevice.DeviceMismatchError) as info:
        todevice.check(tree, device="meta")
    assert str(info.value) == (
        "Expected every tensor on meta, found 2 elsewhere: cpu: ['bad'][0], ['bad'][1]. "
        "Move them with todevice.move(obj, 'meta'), or module.to('meta')."
    )


def test_check_caps_long_lists_with_a_count() -> None:
    tree = [cpu(1) for _ in range(20)] + [meta(1)]
    with pytest.raises(todevice.DeviceMismatchError, match=r"cpu: \[0\], \[1\], .*, \[7\] and 12 more; meta: \[20\]\."):
        todevice.check(tree)


def test_check_a_top_level_tensor() -> None:
    with pytest.raises(todevice.DeviceMismatchError, match="cpu: the top level"):
        todevice.check(cpu(1), device="meta")


# ---------------------------------------------------------------- audit()


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.table = torch.zeros(3)  # a plain attribute: Module.to() skips it
        self.cache = [torch.zeros(1), {"k": torch.zeros(2)}]  # tensors in a plain list


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.register_buffer("ok", torch.zeros(1))
        self.weights = nn.ParameterList([nn.Parameter(torch.ones(1))])


def test_audit_finds_what_module_to_skips_in_nested_submodules() -> None:
    findings = todevice.audit(Outer())
    assert [(f.path, f.kind) for f in findings] == [
        ("inner.table", "unregistered-tensor"),
        ("inner.cache[0]", "tensor-in-container"),
        ("inner.cache[1]['k']", "tensor-in-container"),
    ]
    assert findings[0].message == (
        "inner.table is a tensor attribute on cpu, neither a parameter nor a buffer: Module.to() will not move it. "
        "Register it with self.register_buffer('table', tensor) (persistent=False to keep it out of the "
        "state_dict), or make it an nn.Parameter."
    )
    assert "Use nn.ParameterList or nn.ParameterDict" in findings[1].message


def test_audit_finds_a_module_half_moved() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].bias = nn.Parameter(model[1].bias.detach().to("meta"))  # half moved, as after a partial load
    findings = todevice.audit(model)
    assert [(f.path, f.kind) for f in findings] == [("1", "split-devices")]
    assert findings[0].message == (
        "1 has parameters and buffers on 2 devices (cpu: 1.weight; meta: 1.bias). "
        "Move the module whole with module.to(device)."
    )


def test_audit_of_a_clean_module_is_empty() -> None:
    assert todevice.audit(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))) == []


def test_module_to_really_skips_what_audit_reports() -> None:
    """The findings are true: Module.to() leaves exactly those tensors behind."""
    model = Outer().to("meta")
    left = {p for p, d in todevice.devices({"table": model.inner.table, "cache": model.inner.cache}).items()}
    assert left == {"['table']", "['cache'][0]", "['cache'][1]['k']"}
    assert all(d == CPU for d in todevice.devices({"t": model.inner.table, "c": model.inner.cache}).values())
    assert model.inner.fc.weight.device == META


# ---------------------------------------------------------------- guard()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, extra: Any = None) -> torch.Tensor:
        return self.head(self.encoder(x))


def test_guard_names_the_submodule_the_input_and_both_devices() -> None:
    net = Net()
    net.head.to("meta")
    with todevice.guard(net), pytest.raises(todevice.DeviceMismatchError) as info:
        net(cpu(2))
    assert str(info.value) == (
        "Module head (Linear) is on meta, but its input args[0] is on cpu. "
        "Move the input with todevice.move(x, 'meta'), or the module with module.to(...); "
        "an input that belongs where it is goes in guard(model, ignore=[...])."
    )


def test_guard_catches_an_input_never_moved() -> None:
    net = Net().to("meta")
    with todevice.guard(net), pytest.raises(todevice.DeviceMismatchError, match=r"^Module encoder\.0 \(Linear\)"):
        net(cpu(2))


def test_guard_checks_structured_and_keyword_inputs() -> None:
    class Takes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(meta(2))

        def forward(self, batch: dict[str, Any], *, mask: torch.Tensor) -> torch.Tensor:
            return batch["x"] * self.w * mask

    module = Takes()
    with todevice.guard(module), pytest.raises(todevice.DeviceMismatchError) as info:
        module({"x": meta(2), "y": [cpu(1)]}, mask=cpu(2))
    assert "args[0]['y'][0] is on cpu, kwargs['mask'] is on cpu" in str(info.value)
    assert str(info.value).startswith("The top module (Takes) is on meta")


def test_guard_names_a_module_given_as_input_by_its_path_and_its_tensors_names() -> None:
    class Applies(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(meta(1))

        def forward(self, other: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return x * self.w  # ``other`` kept where it is, for later

    module = Applies()
    with todevice.guard(module), pytest.raises(todevice.DeviceMismatchError) as info:
        module(nn.Linear(1, 1), meta(1))
    assert "args[0].weight is on cpu, args[0].bias is on cpu" in str(info.value)
    with todevice.guard(module, ignore=["args[0]"]):
        assert module(nn.Linear(1, 1), meta(1)).is_meta


def test_guard_lets_right_calls_through() -> None:
    net = Net()
    with todevice.guard(net):
        assert net(cpu(3, 2)).shape == (3, 1)


def test_guard_follows_a_module_moved_after_it_was_installed() -> None:
    net = Net()
    with todevice.guard(net):
        net.to("meta")
        assert net(meta(2)).device == META
        with pytest.raises(todevice.DeviceMismatchError):
            net(cpu(2))


def test_guard_removed_leaves_the_module_exactly_as_before() -> None:
    net = Net()
    before = {name: dict(m._forward_pre_hooks) for name, m in net.named_modules()}
    kwargs_before = {name: dict(m._forward_pre_hooks_with_kwargs) for name, m in net.named_modules()}
    g = todevice.guard(net)
    assert any(m._forward_pre_hooks for m in net.modules())
    g.remove()
    assert {name: dict(m._forward_pre_hooks) for name, m in net.named_modules()} == before
    assert {name: dict(m._forward_pre_hooks_with_kwargs) for name, m in net.named_modules()} == kwargs_before
    net.head.to("meta")
    with pytest.raises(RuntimeError) as info:
        net(cpu(2))
    assert not isinstance(info.value, todevice.DeviceMismatchError)  # PyTorch's own error again


def test_guard_skips_modules_without_tensors_of_their_own() -> None:
    g = todevice.guard(Net())
    assert repr(g) == "todevice.guard(Net, 2 hooks)"  # encoder.0 and head; not Net, encoder, ReLU
    g.remove()


# ---------------------------------------------------------------- regressions


def test_devices_and_check_look_inside_objects_with_their_own_to() -> None:
    from torch.nn.utils.rnn import pack_padded_sequence

    seq = pack_padded_sequence(torch.ones(3, 2, 2), torch.tensor([3, 2]))
    found = todevice.devices({"seq": seq})
    assert found["['seq'].data"] == CPU and found["['seq'].batch_sizes"] == CPU

    class Encoding(dict):  # type: ignore[type-arg]
        def to(self, device: Any) -> Any:
            return self

    with pytest.raises(todevice.DeviceMismatchError, match=r"cpu: objs\[1\]\['input_ids'\]"):
        todevice.check(nn.Linear(1, 1).to("meta"), Encoding(input_ids=cpu(2)))


def test_diagnostics_of_a_cyclic_structure_say_so() -> None:
    cyc: list[Any] = [cpu(1)]
    cyc.append(cyc)
    for call in (todevice.devices, todevice.check):
        with pytest.raises(ValueError, match="Cannot inspect a cyclic structure"):
            call(cyc)


def test_a_cycle_is_named_by_its_path_among_the_objects_checked() -> None:
    cyc: list[Any] = [cpu(1)]
    cyc.append(cyc)
    with pytest.raises(ValueError, match=re.escape("the list at objs[1] contains itself at objs[1][1].")):
        todevice.check(cpu(1), cyc)


class _Holder:
    """An object with its own .to(), which todevice looks into, holding a PackedBatch that holds it."""

    def __init__(self) -> None:
        self.items: dict[str, Any] = {}

    def to(self, *args: Any, **kwargs: Any) -> _Holder:
        return self


def test_a_to_object_held_by_a_packed_batch_it_holds_is_a_cycle() -> None:
    holder = _Holder()
    holder.items["p"] = todevice.pack({"h": holder, "x": cpu(2)})
    for call in (todevice.devices, todevice.check):
        with pytest.raises(
            ValueError, match=re.escape("the _Holder at the top level contains itself at .items['p']['h']")
        ):
            call(holder)


def test_a_container_reached_twice_is_listed_at_both_places() -> None:
    shared = [cpu(1), meta(1)]
    assert set(todevice.devices({"a": shared, "b": shared})) == {"['a'][0]", "['a'][1]", "['b'][0]", "['b'][1]"}


def test_check_against_cpu_with_an_index() -> None:
    assert todevice.check(cpu(2), device="cpu:0") == CPU


def test_audit_of_stock_recurrent_modules_is_empty() -> None:
    assert todevice.audit(nn.LSTM(2, 2)) == [] and todevice.audit(nn.GRU(2, 2, num_layers=2)) == []


def test_audit_finds_modules_in_plain_lists_and_tensors_in_dataclasses() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [nn.Linear(1, 1)]  # Module.to() skips a plain list of modules
            self.state = helpers.Record(torch.zeros(1))

    found = [(f.path, f.kind) for f in todevice.audit(Holder())]
    assert found == [("layers[0]", "tensor-in-container"), ("state.a", "tensor-in-container")]
    assert "Use nn.ModuleList or nn.ModuleDict" in todevice.audit(Holder())[0].message


def test_audit_reports_a_shared_submodule_once() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = Inner()
            self.b = self.a

    assert [f.path for f in todevice.audit(Shared())] == ["a.table", "a.cache[0]", "a.cache[1]['k']"]


def test_audit_leaves_pruned_weights_alone() -> None:
    from torch.nn.utils import prune

    layer = nn.Linear(4, 4)
    prune.l1_unstructured(layer, "weight", amount=0.5)
    assert todevice.audit(layer) == []


def test_guard_accepts_cpu_scalars_as_pytorch_does() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(meta(2))

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.w * x * scale

    module = Scaled()
    with todevice.guard(module):
        assert module(meta(2), torch.tensor(2.0)).device == META


def test_guard_ignores_inputs_that_belong_where_they_are() -> None:
    class Lengths(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(meta(2))

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return self.w * x

    module = Lengths()
    with todevice.guard(module, ignore=["lengths"]):
        module(meta(2), lengths=cpu(3))
    with todevice.guard(module, ignore=["args[1]"]):
        module(meta(2), cpu(3))
    with todevice.guard(module), pytest.raises(todevice.DeviceMismatchError, match=r"kwargs\['lengths'\] is on cpu"):
        module(meta(2), lengths=cpu(3))


def test_devices_and_check_see_inside_a_packed_batch() -> None:
    packed = todevice.pack({"x": cpu(2), "s": torch.eye(2).to_sparse(), "m": [meta(1)]})
    assert todevice.devices({"batch": packed}) == {
        "['batch']['x']": CPU,
        "['batch']['s']": CPU,
        "['batch']['m'][0]": META,
    }
    with pytest.raises(todevice.DeviceMismatchError, match=r"cpu: \['batch'\]\['x'\], \['batch'\]\['s'\]"):
        todevice.check({"batch": packed}, device="meta")
