"""A policy mixing fp16, bf16, tf32, fp8 and fp32 islands on a small transformer (SDPA,
LayerNorm, residuals): runs without dtype errors, matches casting each layer by hand, and
trains; the handle restores the model exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoprec.apply.apply import PolicyHandle, apply_policy
from autoprec.apply.audit import AuditReport
from autoprec.errors import CapabilityError, InputError, PolicyError
from autoprec.policy import Policy
from tests.apply.refs import assert_same_numerics, ref_linear, rel_l2

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")

C, H, V = 32, 2, 48  # width, heads, vocabulary (48: the head is fp8-eligible too)


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(C, C) for _ in range(4))

    def split(self, t: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, H, T, C/H)
        b, n, _ = t.shape
        return t.view(b, n, H, C // H).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.scaled_dot_product_attention(self.split(self.q(x)), self.split(self.k(x)),
                                           self.split(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).flatten(2))  # (B, T, C)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(C), Attn(), nn.LayerNorm(C)
        self.mlp = nn.Sequential(nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.lnf = nn.LayerNorm(C)
        self.head = nn.Linear(C, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.lnf(x))


MIXED = {
    "blocks.0.attn": "bf16",  # bf16 attention (SDPA in bf16)...
    "blocks.0.attn.q": "fp8",  # ...with an fp8 query projection inside it
    "blocks.0.mlp": "fp16",
    "blocks.1": "bf16",  # a whole bf16 block...
    "blocks.1.attn.k": "tf32",  # ...with a tf32 key projection
    "blocks.1.mlp.2": "fp32",  # ...and a fp32 island
}


def hand_forward(m: TinyLM, idx: torch.Tensor) -> torch.Tensor:
    """MIXED by hand: every GEMM with explicit casts, no autocast anywhere."""
    bf = torch.bfloat16
    x = m.emb(idx)
    # block 0: region fp32 (the default)
    b = m.blocks[0]
    h = b.ln1(x)
    q = ref_linear(h, b.attn.q, "fp8", out_dtype=bf)  # fp8 inside bf16: bf16 output
    k, v = ref_linear(h, b.attn.k, "bf16"), ref_linear(h, b.attn.v, "bf16")
    y = F.scaled_dot_product_attention(b.attn.split(q), b.attn.split(k), b.attn.split(v),
                                       is_causal=True)
    x = x + ref_linear(y.transpose(1, 2).flatten(2), b.attn.o, "bf16").float()
    f = F.gelu(ref_linear(b.ln2(x), b.mlp[0], "fp16"))
    x = x + ref_linear(f, b.mlp[2], "fp16").float()
    # block 1: region bf16
    b = m.blocks[1]
    h = b.ln1(x)
    q, v = ref_linear(h, b.attn.q, "bf16"), ref_linear(h, b.attn.v, "bf16")
    k = ref_linear(h, b.attn.k, "tf32").to(bf)  # SDPA under bf16 autocast casts k
    y = F.scaled_dot_product_attention(b.attn.split(q), b.attn.split(k), b.attn.split(v),
                                       is_causal=True)
    x = x + ref_linear(y.transpose(1, 2).flatten(2), b.attn.o, "bf16")
    f = F.gelu(ref_linear(b.ln2(x), b.mlp[0], "bf16"))
    x = x + ref_linear(f, b.mlp[2], "fp32")  # the fp32 island upcasts its bf16 input
    return ref_linear(m.lnf(x), m.head, "fp32")


def _model() -> tuple[TinyLM, torch.Tensor]:
    torch.manual_seed(0)
    return TinyLM().eval(), torch.randint(0, V, (2, 16))


def check_mixed(applied: dict[str, str] = MIXED
                ) -> tuple[torch.Tensor, torch.Tensor, AuditReport]:
    """The model under ``applied`` against :func:`hand_forward` (MIXED by hand), at fp32's
    tolerance (refs.SAME): a layer run in another precision than MIXED gives it fails.
    Returns the output, the fp32 model's output and the audit report."""
    m, idx = _model()
    with torch.no_grad():
        ref = m(idx)
        want = hand_forward(m, idx)
        with apply_policy(m, Policy(layers=applied)) as h:
            got = m(idx)
            report = h.audit(lambda: m(idx))
    assert got.dtype == torch.float32
    assert_same_numerics(got, want)
    return got, ref, report


def test_mixed_policy_matches_hand_casts() -> None:
    got, ref, report = check_mixed()
    assert 1e-4 < rel_l2(got, ref) < 0.1  # really lowered, not absurd
    computed = {r.layer: r.computed for r in report.rows}
    assert computed["blocks.0.attn.q"] == "fp8"
    assert computed["blocks.0.attn"] == "bf16"  # the SDPA in the attention's own code
    assert computed["blocks.1.attn.k"] == "tf32"
    assert computed["blocks.1.mlp.2"] == "fp32"
    assert computed["head"] == "fp32"


def test_mixed_policy_trains_with_fp32_masters() -> None:
    m, idx = _model()
    m.train()
    target = torch.randint(0, V, idx.shape)
    ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    with apply_policy(m, Policy(layers=MIXED)):
        for _ in range(8):
            opt.zero_grad()
            loss = F.cross_entropy(m(idx).flatten(0, 1), target.flatten())
            loss.backward()
            for n, p in m.named_parameters():
                assert p.grad is not None and p.grad.dtype == torch.float32, n
                assert torch.isfinite(p.grad).all(), n
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.9
    for n, p in m.named_parameters():
        assert p.dtype == torch.float32 and p.data_ptr() == ptrs[n], n


def test_remove_restores_exact_forwards() -> None:
    m, idx = _model()
    custom = m.blocks[0].mlp[0].forward  # an instance-level forward set by someone else
    m.blocks[0].mlp[0].forward = custom
    before = {n: mod.__dict__.get("forward") for n, mod in m.named_modules()}
    out = m(idx)
    h = apply_policy(m, Policy(layers=MIXED))
    assert isinstance(h, PolicyHandle) and h.active
    assert m.__dict__.get("forward") is not None
    h.remove()
    h.remove()  # idempotent
    assert not h.active
    assert {n: mod.__dict__.get("forward") for n, mod in m.named_modules()} == before
    assert m.blocks[0].mlp[0].__dict__["forward"] is custom
    assert torch.equal(m(idx), out)


def test_context_manager_removes_on_error() -> None:
    m, idx = _model()
    with pytest.raises(RuntimeError, match="boom"), apply_policy(m, Policy(layers=MIXED)):
        raise RuntimeError("boom")
    assert all("forward" not in mod.__dict__ for mod in m.modules())


def test_second_policy_refused_until_removed() -> None:
    m, _ = _model()
    h = apply_policy(m, Policy(default="bf16"))
    with pytest.raises(InputError, match="already applied"):
        apply_policy(m.blocks[0], Policy(default="fp16"))
    h.remove()
    again = apply_policy(m, Policy(default="fp16"))  # once removed, another policy applies
    assert again.policy.default == "fp16" and any("forward" in mod.__dict__
                                                  for mod in m.modules())
    again.remove()
    assert all("forward" not in mod.__dict__ for mod in m.modules())


@pytest.mark.parametrize("layers, match", [
    ({"blocks.9": "bf16"}, r"layers\['blocks.9'\]: the model has no module"),
    ({"blocks.0.ln1": "fp8"}, r"fp8 rule on an ineligible layer: fp8: LayerNorm"),
])
def test_invalid_policy_leaves_model_unchanged(layers: dict[str, str], match: str) -> None:
    m, idx = _model()
    out = m(idx)
    with pytest.raises(PolicyError, match=match):
        apply_policy(m, Policy(layers={"blocks.0.attn": "bf16", **layers}))
    assert all("forward" not in mod.__dict__ for mod in m.modules())
    assert torch.equal(m(idx), out)


def test_fp8_backend_that_cannot_run_here_is_a_capability_error() -> None:
    from autoprec.device.capability import fp8_backend_capability

    ok, why = fp8_backend_capability("torch", "cpu")
    if ok:
        pytest.skip("this device runs torch fp8")
    m, _ = _model()
    with pytest.raises(CapabilityError, match="fp8 cannot run on cpu") as err:
        apply_policy(m, Policy(layers=MIXED), fp8_backend="torch")
    assert why in str(err.value)
    assert all("forward" not in mod.__dict__ for mod in m.modules())


def test_default_fp8_backend_is_the_best_available() -> None:
    from autoprec.device.capability import best_fp8_backend

    m, _ = _model()
    with apply_policy(m, Policy(layers=MIXED)) as h:
        assert h.fp8_backend == best_fp8_backend(torch.device("cpu"))[0]
        assert h.fp8_reason
    with apply_policy(m, Policy(layers={"blocks.0": "bf16"})) as h:
        assert h.fp8_backend is None  # no fp8 layer: no backend chosen


def test_wrappers_only_at_boundaries() -> None:
    """A uniform policy costs one wrapper (the root), not one per layer."""
    m, _ = _model()
    with apply_policy(m, Policy(default="bf16")) as h:
        assert [w.path for w in h.wrapped] == [""]
    with apply_policy(m, Policy(layers=MIXED)) as h:
        assert {w.path for w in h.wrapped} == {"", *MIXED}


def test_handle_assignment_for_the_cost_model() -> None:
    m, _ = _model()
    with apply_policy(m, Policy(layers=MIXED)) as h:
        a = h.assignment()
    assert a["blocks.0.attn.q"] == "fp8" and a["blocks.0.attn.k"] == "bf16"
    assert a["blocks.1.mlp.2"] == "fp32" and a["head"] == "fp32"
    assert a["blocks.1.mlp.0"] == "bf16" and a["blocks.1.attn.k"] == "tf32"


def test_deepcopy_after_remove_is_a_plain_model() -> None:
    m, idx = _model()
    with apply_policy(m, Policy(layers=MIXED)):
        pass
    c = copy.deepcopy(m)
    assert torch.equal(c(idx), m(idx))
