"""What a move to an accelerator sends, and how: ``_layout.sending``, a pure function of what the batch holds.

Each case is a batch of the size matrix the GPU benchmark times (bench/README.md): the plan it gets
follows from the measured limits named in ``_layout``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests import helpers
from todevice import _layout
from todevice._layout import Sending

KiB, MiB = 1024, 1024 * 1024
FEW = _layout.COALESCE_MIN_TENSORS - 1

# (what the batch is, small tensors and their bytes, tensors copied alone and their bytes, the plan)
CASES = [
    ("(images, labels): 19 MB of images and 32 labels", 1, 256, 1, 32 * 3 * 224 * 224 * 4, Sending(False, True)),
    ("a tokenizer's dict: 3 x 32x512 int64, 128 KiB each", 0, 0, 3, 3 * 128 * KiB, Sending(False, False)),
    ("10 small tensors", 10, 10 * 64, 0, 0, Sending(False, False)),
    (f"{FEW} small tensors of 64 KiB: copied alone, over the limit", FEW, FEW * 64 * KiB, 0, 0, Sending(False, True)),
    ("100 small tensors", 100, 100 * 64, 0, 0, Sending(True, False)),
    ("1,000 small tensors of 16 KiB", 1000, 1000 * 16 * KiB, 0, 0, Sending(True, False)),
    ("8 x 16 MiB", 0, 0, 8, 128 * MiB, Sending(False, True)),
    ("one tensor of 2 MiB among containers", 0, 0, 1, 2 * MiB, Sending(False, False)),
    ("one tensor of 4 MiB among containers", 0, 0, 1, 4 * MiB, Sending(False, True)),
    ("two tensors of 1 MiB", 0, 0, 2, 2 * MiB, Sending(False, True)),
    ("100 small tensors and 8 x 16 MiB", 100, 100 * 64, 8, 128 * MiB, Sending(True, True)),
    ("every tensor already on the device", 0, 0, 0, 0, Sending(False, False)),
]


@pytest.mark.parametrize(("small", "small_bytes", "alone", "alone_bytes", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_the_plan_for_each_batch_of_the_size_matrix(
    small: int, small_bytes: int, alone: int, alone_bytes: int, expected: Sending
) -> None:
    assert _layout.sending(small, small_bytes, alone, alone_bytes, None) == expected


def test_small_tensors_are_coalesced_from_the_break_even_count() -> None:
    least = _layout.COALESCE_MIN_TENSORS
    assert not _layout.sending(least - 1, 64, 0, 0, None).together
    assert _layout.sending(least, 64, 0, 0, None).together
    assert not _layout.sending(2, 64, 0, 0, None).together  # a pair never is


def test_the_option_overrides_the_count() -> None:
    assert _layout.sending(2, 64, 0, 0, True) == Sending(True, False)
    assert _layout.sending(1000, 64 * 1000, 0, 0, False) == Sending(False, False)
    assert _layout.sending(0, 0, 0, 0, True) == Sending(False, False)  # nothing small to coalesce
    # Not coalesced, the small tensors count among those copied alone.
    assert _layout.sending(1000, 1000 * 16 * KiB, 0, 0, False) == Sending(False, True)


def test_the_limit_is_the_driver_s_and_counts_what_is_copied_alone() -> None:
    limit, one = _layout.PAGEABLE_DIRECT_MAX_BYTES, _layout.PAGEABLE_DIRECT_MAX_BYTES_ONE
    assert not _layout.sending(0, 0, 2, limit, None).staged
    assert _layout.sending(0, 0, 2, limit + 1, None).staged
    assert not _layout.sending(0, 0, 1, one, None).staged
    assert _layout.sending(0, 0, 1, one + 1, None).staged
    # Coalesced small tensors go in a pinned buffer of their own: they do not count.
    assert not _layout.sending(100, 100 * 64 * KiB, 1, one, None).staged


def test_the_plan_is_a_pure_function() -> None:
    """The same inputs give the same plan, whatever was asked before."""
    first = [_layout.sending(*c[1:5], None) for c in CASES]
    for c in reversed(CASES):
        _layout.sending(*c[1:5], True)
    assert [_layout.sending(*c[1:5], None) for c in CASES] == first


# ---------------------------------------------------------------- staged tensors, in pieces


@pytest.mark.parametrize(
    ("make", "dtype", "pieces"),
    [
        (lambda: torch.randn(2500), torch.float32, 3),  # 10,000 bytes: 1,024 + 1,024 + 452 elements
        (lambda: torch.randn(50, 50).t(), torch.float32, 3),  # dense, transposed: in memory order, as its target
        (lambda: torch.randn(1, 4, 25, 25).contiguous(memory_format=torch.channels_last), torch.float64, 3),
        (lambda: torch.randn(2500), torch.float16, 2),  # cast on the host, before it is sent: 2,048 halves a piece
        (lambda: torch.randn(1000), torch.float32, 1),  # 4,000 bytes: one piece
    ],
    ids=["contiguous", "transposed", "channels-last, cast after", "cast before", "one piece"],
)
def test_a_staged_tensor_goes_in_pieces_each_sent_before_the_next_is_written(
    monkeypatch: pytest.MonkeyPatch, make: Any, dtype: torch.dtype, pieces: int
) -> None:
    """``send_staged`` on the host, a plain host block standing in for pinned memory: each piece written into the
    block, then copied out of it, in that order, with the target's strides kept and its values right."""
    monkeypatch.setattr(_layout, "STAGE_CHUNK_BYTES", 4096)
    monkeypatch.setattr(_layout._stream, "pinned", lambda n, dt, dev: torch.empty(n, dtype=dt))
    src = make()
    out = torch.empty_like(src, dtype=dtype)  # as stage() makes each target: the source's strides where dense
    copies = helpers.Copies()
    with copies:
        assert _layout.send_staged([(src, out)])
    into_out = [dst.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for dst, _ in copies.pairs]
    assert into_out == [False, True] * pieces  # written into the block, sent out of it, written, sent...
    assert out.stride() == src.stride() and torch.equal(out, src.to(dtype))
