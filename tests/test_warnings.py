"""The suite's warning filter (pyproject's ``filterwarnings``): by the module a warning comes from.

A warning raised inside torch or another package is shown, never a failure: its wording and its
presence change with each release and each build (importing inductor raises a DeprecationWarning
on some). A warning from todevice, from these tests or from the doctests fails the test.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from todevice import _stream


class _Scripted(torch.jit.ScriptModule):
    """Defined at import: ``torch.jit.script_method`` raises torch's own DeprecationWarning while the
    suite is collected, as importing inductor does on some builds. Were the filter ``error``, this
    module could not be collected."""

    @torch.jit.script_method
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_a_deprecation_raised_inside_torch_is_not_a_failure() -> None:
    class Scripted(torch.jit.ScriptModule):
        @torch.jit.script_method  # the DeprecationWarning again, from torch.jit, while the test runs
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    assert Scripted()(torch.ones(1)).item() == 2
    assert _Scripted()(torch.ones(1)).item() == 2


def test_a_warning_raised_by_todevice_fails_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pinned_memory_left(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA error: out of memory")

    monkeypatch.setattr(_stream.torch, "empty", no_pinned_memory_left)
    with pytest.raises(RuntimeWarning, match="page-locked"):  # todevice._stream's own warning, as an error
        _stream.pinned(64, torch.uint8, torch.device("cpu"))


def test_a_warning_raised_by_a_test_fails_it() -> None:
    with pytest.raises(UserWarning, match="from a test"):
        warnings.warn("from a test", UserWarning, stacklevel=1)


def test_a_warning_torch_raises_from_a_call_made_here_fails_the_test() -> None:
    """A C++ op warns from the Python frame that called it: a lossy cast made in a test is the test's."""
    always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # torch gives this one once per process, and another test may have had it
    try:
        with pytest.raises(UserWarning, match="Casting complex values to real"):
            torch.ones(2, dtype=torch.complex64).to(torch.float32)
    finally:
        torch.set_warn_always(always)


def test_torch_warning_that_numpy_is_missing_is_shown_not_raised() -> None:
    """`pip install .` then `pip install pytest hypothesis` leaves numpy out, and torch warns so from its own module
    when it first makes a tensor. Under the suite's filter that warning is shown, and the tests go on."""
    from torch._subclasses import functional_tensor

    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit(
            "Failed to initialize NumPy: No module named 'numpy'",
            UserWarning,
            functional_tensor.__file__,
            368,
            module=functional_tensor.__name__,
        )
    assert [str(w.message) for w in seen] == ["Failed to initialize NumPy: No module named 'numpy'"]
