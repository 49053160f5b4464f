"""Every precision boundary, for every precision, forward and backward, against a hand
reference with explicit casts (tests/apply/refs.py) that rounds every layer at its own
precision, compared at fp32's tolerance whatever the layers' precisions (``SAME``): a layer
run in another precision than its rule's fails the comparison
(tests/apply/test_wrong_precision_is_caught.py shows it for every case here).

Hand semantics of one wrapped module (apply.py): a fp32/tf32 module upcasts 16-bit
inputs; a bf16/fp16 module casts per op (autocast); leaving a wrapped module, 16-bit
outputs become fp32 (exact) when the caller's region is fp32/tf32 and stay as they are
in an autocast caller (its consumers cast as autocast decides); fp8 outputs are in the
caller's autocast dtype (fp32 outside autocast).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoprec.apply.apply import apply_policy
from autoprec.formats.precisions import PRECISIONS, dtype_tols
from autoprec.policy import Policy
from tests.apply.refs import DTYPES, assert_same_numerics, grads, ref_linear

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")

D = 32  # every Linear is 32 -> 32: fp8-eligible (multiples of 16)
OTHER = {"fp32": "bf16", "tf32": "fp16", "bf16": "fp16", "fp16": "bf16", "fp8": "bf16",
         "mxfp8": "bf16", "nvfp4": "bf16"}
FORMATS = ("fp8", "mxfp8", "nvfp4")  # GEMM formats: Linear backends, never a region
_AMBIENT = {"fp32": torch.float32, "tf32": torch.float32, **DTYPES}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(D, D)
        self.act = nn.ReLU()
        self.l2 = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D)
        return self.norm(self.l2(self.act(self.l1(x))))


class Net(nn.Module):
    """a -> blk(l1, relu, l2, norm) -> c."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.blk = Block()
        self.c = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.blk(self.a(x)))


class Tied(nn.Module):
    """Two Linears sharing one weight Parameter (tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.t1 = nn.Linear(D, D)
        self.t2 = nn.Linear(D, D)
        self.t2.weight = self.t1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.t2(torch.relu(self.t1(x)))


class Twice(nn.Module):
    """One Linear called twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


# -- hand forward ------------------------------------------------------------------------

def _exit(y: torch.Tensor, ambient: str) -> torch.Tensor:
    if y.dtype in DTYPES.values() and ambient in ("fp32", "tf32"):
        return y.float()
    return y


def _lin(x: torch.Tensor, lin: nn.Linear, p: str, ambient: str) -> torch.Tensor:
    """A Linear at ``p`` called from a region at ``ambient``."""
    return _exit(ref_linear(x, lin, p, out_dtype=_AMBIENT[ambient]), ambient)


def _region_of(policy: Policy, path: str) -> str:
    from autoprec.plan import resolve_path

    return resolve_path(policy, path, nn.Identity()).region


def _prec(policy: Policy, model: nn.Module, path: str) -> str:
    from autoprec.plan import resolve_path

    return resolve_path(policy, path, model.get_submodule(path)).precision


def hand_net(net: Net, x: torch.Tensor, pol: Policy) -> torch.Tensor:
    root = _region_of(pol, "")
    blk = _region_of(pol, "blk")
    h = _lin(x, net.a, _prec(pol, net, "a"), root)
    # entering blk: a fp32/tf32 region upcasts its inputs; autocast ones cast per op
    hb = h.float() if blk in ("fp32", "tf32") else h
    hb = torch.relu(_lin(hb, net.blk.l1, _prec(pol, net, "blk.l1"), blk))
    hb = net.blk.norm(_lin(hb, net.blk.l2, _prec(pol, net, "blk.l2"), blk))
    h = _exit(hb, root) if blk != root else hb
    return _lin(h, net.c, _prec(pol, net, "c"), root)


def hand_pair(m: nn.Module, first: nn.Linear, second: nn.Linear, x: torch.Tensor,
              pol: Policy, p1: str, p2: str) -> torch.Tensor:
    root = _region_of(pol, "")
    return _lin(torch.relu(_lin(x, first, p1, root)), second, p2, root)


# -- checks ------------------------------------------------------------------------------

#: A case: the model, the policy its hand reference follows, and that reference.
Case = tuple[nn.Module, Policy, Callable[[torch.Tensor], torch.Tensor]]


def check(model: nn.Module, pol: Policy, hand: Callable[[torch.Tensor], torch.Tensor],
          applied: Policy | None = None, target: str | None = None) -> None:
    """``model`` under ``applied`` (default: ``pol``) computes what ``hand`` computes by
    the rules of ``pol``, forward and backward, at :data:`SAME` (see refs.py): one layer
    in another precision fails it. ``applied`` is how tests/apply/test_wrong_precision_is_caught.py
    injects the wrong precision."""
    torch.manual_seed(1)
    x = torch.randn(2, 4, D)
    params = [p for _, p in model.named_parameters()]

    block = bool({"mxfp8", "nvfp4"} & set(pol.precisions))  # forward references only
    xr = x.clone().requires_grad_(not block)
    want = hand(xr)
    want_g = None if block else grads(want, [xr, *params])

    before = [(p.data_ptr(), p.dtype, p.detach().clone()) for p in params]
    with apply_policy(model, applied or pol, target=target):
        xa = x.clone().requires_grad_(not block)
        got = model(xa)
        got_g = None if block else grads(got, [xa, *params])
    assert_same_numerics(got, want)
    if got_g is None:
        return
    for name, g, w in zip(["x", *[n for n, _ in model.named_parameters()]], got_g, want_g):
        assert g is not None and w is not None, name
        assert g.dtype == w.dtype == torch.float32, name  # fp32 master gradients
        assert_same_numerics(g, w, f"grad {name}")
    # fp32 masters untouched: same storage, dtype and values
    for p, (ptr, dt, val) in zip(params, before):
        assert p.data_ptr() == ptr and p.dtype == dt == torch.float32
        assert torch.equal(p.detach(), val)


def _net_cases(p: str) -> dict[str, tuple[str, dict[str, str]]]:
    o = OTHER[p]
    low_default = "fp16" if p == "bf16" else "bf16"
    return {
        # one lowered layer in a fp32 model
        "single": ("fp32", {"a": p}),
        # a fp32 island inside a lowered block
        "island_in_block": ("fp32", {"blk": p, "blk.l2": "fp32"}),
        # a fp32 island inside a lowered default (fp8: a root rule; l2 stays fp32)
        "island_in_default": (("fp32", {"": p, "blk.l2": "fp32"}) if p in FORMATS
                              else (p, {"blk.l2": "fp32"})),
        # two lowered siblings of different precisions in a fp32 parent
        "siblings": ("fp32", {"a": p, "blk.l1": o}),
        # a neighbour of another precision inside a lowered block
        "neighbour_in_block": ("fp32", {"blk": o if p in FORMATS else p,
                                         "blk.l2": p if p in FORMATS else o}),
        # a block left at the default between two lowered layers
        "gap": ("fp32", {"a": p, "c": p}),
        # ... and with a lowered default between them
        "gap_lowered_default": (low_default, {"a": p, "c": p}),
    }


NET_CASES = list(_net_cases("bf16"))


def net_case(p: str, case: str) -> Case:
    default, layers = _net_cases(p)[case]
    torch.manual_seed(0)
    net = Net()
    pol = Policy(default=default, layers=layers)
    return net, pol, lambda x: hand_net(net, x, pol)


def tied_case(p: str, default: str) -> Case:
    torch.manual_seed(0)
    m = Tied()
    o = OTHER[p] if OTHER[p] != default else "fp16"
    pol = Policy(default=default, layers={"t1": p, "t2": o})
    return m, pol, lambda x: hand_pair(m, m.t1, m.t2, x, pol, p, o)


def twice_case(p: str, default: str) -> Case:
    torch.manual_seed(0)
    m = Twice()
    pol = Policy(default=default, layers={"lin": p})
    return m, pol, lambda x: hand_pair(m, m.lin, m.lin, x, pol, p, p)


def shared_case(p: str) -> Case:
    torch.manual_seed(0)
    m = Twice()
    m.again = m.lin  # second path to the same module
    pol = Policy(default="fp32", layers={"lin": p, "again": p})
    return m, pol, lambda x: hand_pair(m, m.lin, m.lin, x, pol, p, p)


@pytest.mark.parametrize("p", PRECISIONS)
@pytest.mark.parametrize("case", NET_CASES)
def test_net_boundaries(p: str, case: str) -> None:
    check(*net_case(p, case))


@pytest.mark.parametrize("p", PRECISIONS)
@pytest.mark.parametrize("default", ["fp32", "bf16"])
def test_tied_weights_two_precisions(p: str, default: str) -> None:
    """A weight used in two precisions in one outer region (the autocast-cache trap)."""
    check(*tied_case(p, default))


@pytest.mark.parametrize("p", PRECISIONS)
@pytest.mark.parametrize("default", ["fp32", "fp16"])
def test_module_called_twice(p: str, default: str) -> None:
    check(*twice_case(p, default))


@pytest.mark.parametrize("p", ["bf16", "fp16", "fp8"])
def test_shared_module_under_two_paths(p: str) -> None:
    """A module registered under two paths computes in the one precision both give it."""
    check(*shared_case(p))


def test_global_autocast_does_not_override_the_default() -> None:
    """The root is always wrapped: a fp32 default holds under a caller's autocast."""
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 4, D)
    want = net(x)
    with apply_policy(net, Policy(default="fp32", layers={})), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        got = net(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **dtype_tols("fp32"))


class Cat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x1 = nn.Linear(D, D)
        self.x2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.x1(x), self.x2(x)], -1)


def cat_case() -> Case:
    torch.manual_seed(0)
    m = Cat()
    pol = Policy(default="bf16", layers={"x2": "fp16"})
    return m, pol, lambda x: torch.cat([ref_linear(x, m.x1, "bf16").float(),
                                        ref_linear(x, m.x2, "fp16").float()], -1)


def test_bf16_then_fp16_outputs_meet_in_cat_as_on_cuda() -> None:
    """Outputs of fp16 and bf16 siblings meet in ``cat`` inside a bf16 region. Nothing is
    cast when they leave (an autocast caller casts at its consumers); CUDA's cat promotes
    bf16 with fp16 to fp32, and a CUDA target applied on a CPU runs it that way."""
    m, pol, hand = cat_case()
    with apply_policy(m, pol, target="h100"):
        assert m(torch.randn(3, D)).dtype == torch.float32
    check(m, pol, hand, target="h100")


def test_bf16_and_fp16_in_a_cpu_promote_op_is_one_clear_error() -> None:
    """CPU autocast's cat refuses bf16 mixed with fp16: a CPU-target plan that does that
    is refused naming the region (the schedule flags the same plan as invalid)."""
    from autoprec.errors import PolicyError

    m = Cat()
    with apply_policy(m, Policy(default="bf16", layers={"x2": "fp16"}), target="cpu"), \
            pytest.raises(PolicyError, match="same precision"):
        m(torch.randn(3, D))


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D), one head
        return F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x))


def sdpa_case() -> Case:
    torch.manual_seed(0)
    m = Attn()
    pol = Policy(default="fp32", layers={"q": "fp16", "k": "bf16", "v": "fp8"})
    return m, pol, lambda x: F.scaled_dot_product_attention(
        ref_linear(x, m.q, "fp16").float(), ref_linear(x, m.k, "bf16").float(),
        ref_linear(x, m.v, "fp8"))


def test_sdpa_with_q_k_v_from_three_precisions() -> None:
    """SDPA in a fp32 block whose q, k, v come from fp16, bf16 and fp8 leaves."""
    m, pol, hand = sdpa_case()
    with apply_policy(m, pol):
        assert m(torch.randn(2, 8, D)).dtype == torch.float32
    check(m, pol, hand)
