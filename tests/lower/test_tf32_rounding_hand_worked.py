"""``round_to_tf32`` against bit patterns worked out by hand.

tf32 keeps fp32's sign, its 8 exponent bits and the top 10 of its 23 mantissa bits
(NVIDIA A100 whitepaper, "TF32"); the 13 dropped bits (mask 0x1FFF) round to nearest, ties
to even: a dropped part above 0x1000 rounds up, below it down, exactly 0x1000 goes to the
value whose kept lowest bit (bit 13, 0x2000) is 0. Rounding up adds 0x2000 to the bit
pattern, so a mantissa of all ones carries into the exponent. Each case is (fp32 bits in,
tf32 bits out), with the arithmetic beside it.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from autoprec.lower.forward import round_to_tf32
from tests.helpers.new_bytes import NewBytes
from tests.reference_formats import round_tf32

CASES = {
    # 1 + 2**-11: dropped 0x1000, a tie; kept lowest bit 0 -> stays 1.0
    "1+2^-11 ties to even (down)": (0x3F801000, 0x3F800000),
    # 1 + 3 * 2**-11 = 1 + 2**-10 + 2**-11: a tie, kept lowest bit 1 -> up to 1 + 2**-9
    "1+3*2^-11 ties to even (up)": (0x3F803000, 0x3F804000),
    # 1 + 2**-11 + 2**-23: just above the tie -> up to 1 + 2**-10
    "just above a tie": (0x3F801001, 0x3F802000),
    # 1 + 2**-11 - 2**-23: just below the tie -> down to 1.0
    "just below a tie": (0x3F800FFF, 0x3F800000),
    # 1.5 and 1 + 2**-10 are tf32 values already
    "1.5 exact": (0x3FC00000, 0x3FC00000),
    "1+2^-10 exact": (0x3F802000, 0x3F802000),
    # 0.1 = 0x3DCCCCCD: dropped 0x0CCD < 0x1000 -> 0x3DCCC000 = 0.0999755859375
    "0.1": (0x3DCCCCCD, 0x3DCCC000),
    # 2 - 2**-23: every mantissa bit set, dropped 0x1FFF -> carries into the exponent: 2.0
    "carry into the exponent": (0x3FFFFFFF, 0x40000000),
    # negatives round their magnitude the same way (sign-magnitude)
    "-(1+3*2^-11)": (0xBF803000, 0xBF804000),
    "-(1+2^-11)": (0xBF801000, 0xBF800000),
    "-0.0 keeps its sign": (0x80000000, 0x80000000),
    "+0.0": (0x00000000, 0x00000000),
    # near fp32's max: the largest tf32 finite is 0x7F7FE000 (1.1111111111b * 2**127)
    "largest tf32 finite": (0x7F7FE000, 0x7F7FE000),
    "below the tie under max": (0x7F7FEFFF, 0x7F7FE000),
    # fp32 max 0x7F7FFFFF: dropped 0x1FFF -> carries into exponent 255: +inf
    "fp32 max -> inf": (0x7F7FFFFF, 0x7F800000),
    # a tie above the largest tf32 finite, kept lowest bit 1 -> up: inf
    "tie past max -> inf": (0x7F7FF000, 0x7F800000),
    "-fp32 max -> -inf": (0xFF7FFFFF, 0xFF800000),
    "+inf": (0x7F800000, 0x7F800000),
    "-inf": (0xFF800000, 0xFF800000),
    # subnormals: the same 13 bits drop (tf32 keeps fp32's subnormal range, 10 bits of it)
    "smallest subnormal -> 0": (0x00000001, 0x00000000),
    "subnormal tie, even -> down": (0x00001000, 0x00000000),
    "subnormal above the tie -> up": (0x00001001, 0x00002000),
    "subnormal tie, odd -> up": (0x00003000, 0x00004000),
    "-subnormal tie, odd -> up": (0x80003000, 0x80004000),
    # the largest subnormal carries into the smallest normal, 2**-126
    "largest subnormal -> 2^-126": (0x007FFFFF, 0x00800000),
}

#: NaNs whose payload sits in the dropped bits: rounding the pattern would make 0x7F800001
#: +inf and wrap 0x7FFFFFFF to -0.0. They must stay NaN.
NANS = (0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF801234)


class _Sub(torch.Tensor):
    """A tensor subclass: round_to_tf32 takes its torch path (a CPU plain tensor: numpy)."""


def _as_path(x: torch.Tensor, path: str) -> torch.Tensor:
    return x.as_subclass(_Sub) if path == "torch" else x


def _f32(bits: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32).copy())


def _bits(x: torch.Tensor) -> list[int]:
    return [int(b) for b in x.detach().as_subclass(torch.Tensor).contiguous().numpy()
            .view(np.uint32)]


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_hand_worked_bit_patterns(path: str) -> None:
    names = list(CASES)
    x = _f32([CASES[n][0] for n in names])
    got = _bits(round_to_tf32(_as_path(x, path)))
    want = [CASES[n][1] for n in names]
    wrong = {n: (hex(CASES[n][0]), hex(g), hex(w))
             for n, g, w in zip(names, got, want) if g != w}
    assert wrong == {}, f"case: (in, got, want) {wrong}"


def test_the_hand_values_are_what_they_say() -> None:
    """The bit patterns above are the numbers their names give."""
    v = dict(zip(CASES, _f32([c[0] for c in CASES.values()]).tolist()))
    assert v["1+2^-11 ties to even (down)"] == 1 + 2**-11
    assert v["1+3*2^-11 ties to even (up)"] == 1 + 3 * 2**-11
    assert v["carry into the exponent"] == 2 - 2**-23
    assert v["fp32 max -> inf"] == torch.finfo(torch.float32).max
    assert v["largest subnormal -> 2^-126"] == 2**-126 - 2**-149
    out = dict(zip(CASES, _f32([c[1] for c in CASES.values()]).tolist()))
    assert out["1+3*2^-11 ties to even (up)"] == 1 + 2**-9
    assert out["0.1"] == 0.0999755859375
    assert out["largest tf32 finite"] == (2 - 2**-10) * 2**127


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_nan_stays_nan(path: str) -> None:
    x = _f32(list(NANS) + [0x3F803000])  # a NaN beside a normal value: only NaNs kept
    got = round_to_tf32(_as_path(x, path)).as_subclass(torch.Tensor)
    assert torch.isnan(got[:-1]).all(), [hex(b) for b in _bits(got[:-1])]
    assert _bits(got[-1:]) == [0x3F804000]


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_agrees_with_the_definition_on_random_bit_patterns(path: str) -> None:
    """Every fp32 class (normals, subnormals, ±inf, NaN) against the reference written from
    the definition (tests/reference_formats.py: a compare-and-add on the dropped bits, not
    round_to_tf32's add-0xFFF-and-mask)."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**32, (1 << 16,), generator=g, dtype=torch.int64)
    x = _f32(bits.tolist())
    got = round_to_tf32(_as_path(x, path)).as_subclass(torch.Tensor)
    want = round_tf32(x)
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all()), [hex(b) for b in _bits(x[~same][:5])]


def test_gradient_passes_straight_through() -> None:
    x = _f32([0x3F803000, 0x3DCCCCCD, 0xBF801000]).requires_grad_()
    y = round_to_tf32(x)
    assert _bits(y) == [0x3F804000, 0x3DCCC000, 0xBF800000]
    (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [1.0, 2.0, 3.0]


def test_only_fp32_is_rounded() -> None:
    """bf16 / fp16 / fp64 tensors are returned as they are (tf32 is a fp32 matmul mode)."""
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        x = torch.tensor([1 + 2**-11 + 2**-20], dtype=dt)
        assert round_to_tf32(x) is x


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_weight_that_requires_grad_is_rounded_into_one_new_tensor(grad: bool) -> None:
    """A master weight (``requires_grad``) rounded with or without autograd: the rounded
    copy (numpy's one buffer on a CPU) is the only whole-size memory taken; torch allocates
    none (the straight-through estimator as ``x + (rounded - x)`` took four whole-size
    temporaries: ~9 GB for an 8 B Llama's fp32 LM head)."""
    w = torch.randn(256, 512).requires_grad_(True)
    size = w.numel() * 4
    with torch.set_grad_enabled(grad), NewBytes():
        round_to_tf32(w)  # first calls import and cache: not counted
    tracemalloc.start()
    try:
        with torch.set_grad_enabled(grad), NewBytes() as mode:
            out = round_to_tf32(w)
        _, numpy_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(out.detach(), round_tf32(w.detach()))
    assert out.requires_grad == grad
    assert mode.largest < size, mode.sizes
    assert size <= numpy_peak < 1.5 * size, numpy_peak


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_weight_widened_from_bf16_is_returned_as_it_is(grad: bool) -> None:
    """fp32 masters loaded from bf16 have tf32's precision already: rounding them is the
    identity, so the tensor itself comes back (no copy of an 8 B LM head); one value with
    a dropped bit set anywhere and it is rounded."""
    w = torch.nn.Parameter(torch.randn(1024, 1024).bfloat16().float())
    with torch.set_grad_enabled(grad):
        assert round_to_tf32(w) is w
        w2 = w.detach().clone()
        w2.view(-1)[-1] += 2.0**-20  # the last value only
        out = round_to_tf32(w2)
    assert out is not w2
    assert torch.equal(out, round_tf32(w2))
