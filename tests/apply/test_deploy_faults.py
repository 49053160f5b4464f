"""The deploy form under faults, as a user hits them (issue 47; docs/robustness.md).

- The guard on the plan tune writes most often — uniform ``default: fp16``, no rules — fed
  an input that overflows fp16 in one layer: ``detect`` warns, ``fallback`` returns
  exactly what the plan with that layer raised computes, ``raise`` names the layer (it
  crashed in torch: "mat1 and mat2 must have the same dtype"); also with a bf16 rule,
  with a fp8 / mxfp8 / nvfp4 leaf, and compiled. The consumer casts the re-run needs are
  on the model during the re-run only.
- Training a deploy-form model with the user's own loop (SGD, AdamW): ``loss.backward()``
  is refused in one line naming the train form, and ``remove()`` gives the untouched
  masters; the train form trains them.
- ``model.float()`` / ``.half()`` / ``.to(dtype)`` after apply: refused in one line, the
  model unchanged and still running; ``.to("cpu")`` and a storage move keep working.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autoprec.apply.apply import apply_policy
from autoprec.device.capability import capability
from autoprec.errors import GuardError, GuardWarning, InputError
from autoprec.policy import Policy
from autoprec.training.train import prepare_training

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.policy.PolicyWarning")

RANGE = "2"  # the layer whose output passes fp16's 65504 on a 10x input


def _net() -> nn.Sequential:
    """(B, 64) -> (B, 32): layer "2" writes ~8e3 on calibration-sized inputs, ~8e4 (past
    fp16's 65504) on inputs 10x larger; the LayerNorm after it brings the scale back."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128),
                        nn.LayerNorm(128), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 32))
    with torch.no_grad():
        net[2].weight.mul_(9e3)
    return net.eval()


X = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
BIG = X * 10


def _pol(rules: dict[str, str] | None = None, **kw: object) -> Policy:
    return Policy(default="fp16", layers=dict(rules or {}), form="deploy", **kw)


def _forwards(net: nn.Module) -> dict[int, object]:
    return {id(m): m.__dict__.get("forward") for m in net.modules()}


PLANS = {
    "uniform": {},  # what tune writes when model.to(fp16) wins
    "mixed": {"0": "bf16"},
    "fp8": {"4": "fp8"},
    "mxfp8": {"4": "mxfp8"},
    "nvfp4": {"4": "nvfp4"},
}


def test_the_uniform_plan_overflows_unguarded_and_passes_calibration_inputs() -> None:
    net = _net()
    with torch.no_grad(), apply_policy(net, _pol(), guard="off"):
        assert torch.isfinite(net(X)).all()
        assert not torch.isfinite(net(BIG)).all()


@pytest.mark.parametrize("plan", list(PLANS))
def test_fallback_returns_the_raised_plans_output(plan: str) -> None:
    net = _net()
    rules = PLANS[plan]
    with torch.no_grad(), apply_policy(net, _pol({**rules, RANGE: "bf16"})):
        want = net(BIG)
    assert torch.isfinite(want).all()
    with torch.no_grad(), apply_policy(net, _pol(rules), guard="fallback") as h:
        fast = _forwards(net)
        calm = net(X)
        with pytest.warns(GuardWarning, match=f"re-ran with '{RANGE}' in bf16"):
            got = net(BIG)
        # the re-run's consumer casts are off the model again: the fast path is unchanged
        assert _forwards(net) == fast
        assert torch.equal(net(X), calm)
        stats = h.guard_stats()
    assert torch.equal(got, want)
    assert stats[RANGE].overflows == 1 and stats[RANGE].fallbacks == 1


@pytest.mark.parametrize("plan", list(PLANS))
def test_raise_names_the_layer_and_the_value(plan: str) -> None:
    net = _net()
    with torch.no_grad(), apply_policy(net, _pol(PLANS[plan]), guard="raise") as h:
        fast = _forwards(net)
        with pytest.raises(GuardError) as err:
            net(BIG)
        assert _forwards(net) == fast
        assert torch.isfinite(net(X)).all()
    msg = str(err.value)
    assert "\n" not in msg and err.value.layer == RANGE
    assert f"layer '{RANGE}' (fp16)" in msg and "> 65504, the fp16 maximum" in msg
    assert h.guard_stats()[RANGE].overflows == 1


def test_detect_on_the_uniform_plan_warns_and_returns_the_output() -> None:
    net = _net()
    with torch.no_grad(), apply_policy(net, _pol(), guard="detect") as h, \
            pytest.warns(GuardWarning, match=f"layer '{RANGE}' \\(fp16\\)"):
        y = net(BIG)
    assert not torch.isfinite(y).all()
    assert h.guard_stats()[RANGE].overflows == 1 and h.guard_stats()[RANGE].fallbacks == 0


def test_a_compiled_uniform_plan_falls_back_like_eager() -> None:
    net = _net()
    with torch.no_grad(), apply_policy(net, _pol(), guard="fallback"), \
            pytest.warns(GuardWarning):
        eager = net(BIG)
    with torch.no_grad(), apply_policy(net, _pol(), guard="fallback") as h:
        compiled = torch.compile(net)
        calm = compiled(X)
        with pytest.warns(GuardWarning, match=f"re-ran with '{RANGE}' in bf16"):
            got = compiled(BIG)
        again = compiled(X)
    assert torch.isfinite(got).all()
    # inductor rounds otherwise than eager; the re-run itself is eager
    assert float((got.float() - eager.float()).norm() / eager.float().norm()) < 1e-2
    assert torch.equal(again, calm)
    assert h.guard_stats()[RANGE].fallbacks == 1


# -- training under the deploy form ------------------------------------------------------

OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}


def _steps(net: nn.Module, opt: torch.optim.Optimizer, n: int = 3) -> None:
    y = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    for _ in range(n):
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(X).float(), y)
        loss.backward()
        opt.step()


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("default", ["bf16", "fp16"])
def test_training_a_deployed_model_is_refused_and_nothing_is_lost(opt: str, default: str
                                                                  ) -> None:
    net = _net().train()
    masters = dict(net.named_parameters())
    before = {k: v.detach().clone() for k, v in masters.items()}
    h = apply_policy(net, Policy(default=default, form="deploy"))
    optimizer = OPTIMIZERS[opt](list(net.parameters()))  # the user's loop, after apply
    with pytest.raises(InputError) as err:
        _steps(net, optimizer)
    msg = str(err.value)
    assert "\n" not in msg and "deploy form" in msg and "form: train" in msg
    assert "prepare_training" in msg
    h.remove()
    assert dict(net.named_parameters()) == masters  # the same objects ...
    for k, v in net.named_parameters():
        assert v.dtype == torch.float32 and torch.equal(v, before[k])  # ... untouched


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_the_train_form_trains_the_masters_and_keeps_them(opt: str) -> None:
    net = _net().train()
    before = {k: v.detach().clone() for k, v in net.named_parameters()}
    setup = prepare_training(net, Policy(default="bf16", form="deploy"))  # form="train"
    _steps(net, OPTIMIZERS[opt](list(net.parameters())))
    setup.handle.remove()
    assert not torch.equal(net[0].weight, before["0.weight"])


def test_a_fp32_island_trains_and_input_gradients_are_not_refused() -> None:
    """Nothing is lost there: an fp32 layer holds its master itself, and a gradient with
    respect to the input never reaches a deployed copy's storage."""
    net = _net()
    for p in net.parameters():
        p.requires_grad_(False)
    net[6].weight.requires_grad_(True)
    with apply_policy(net, _pol({"6": "fp32"})):
        opt = torch.optim.SGD([net[6].weight], lr=0.1)
        before = net[6].weight.detach().clone()
        net(X).float().sum().backward()
        opt.step()
        assert not torch.equal(net[6].weight, before)
        x = X.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(net(x).float().sum(), x)
    assert torch.isfinite(g).all()
    assert not torch.equal(net[6].weight, before)  # kept past remove()


# -- dtype and device changes after apply -------------------------------------------------

@pytest.mark.parametrize("change", ["float", "half", "bfloat16", "to_double", "submodule"])
@pytest.mark.parametrize("form", ["deploy", "train"])
def test_a_dtype_change_after_apply_is_one_line_and_changes_nothing(change: str, form: str
                                                                    ) -> None:
    net = _net()
    with torch.no_grad(), apply_policy(net, Policy(default="bf16", layers={"6": "fp32"},
                                                   form=form)):
        out = net(X)
        dtypes = {k: v.dtype for k, v in net.state_dict().items()}
        do = {"float": lambda: net.float(), "half": lambda: net.half(),
              "bfloat16": lambda: net.bfloat16(),
              "to_double": lambda: net.to(torch.float64),
              "submodule": lambda: net[6].half()}[change]
        if form == "train" and change == "float":
            do()  # fp32 masters made fp32: nothing changes, nothing to refuse
        else:
            with pytest.raises(InputError) as err:
                do()
            msg = str(err.value)
            assert "\n" not in msg and "dtype change after apply_policy" in msg
            assert "nothing was changed" in msg and "remove() the policy" in msg
        assert {k: v.dtype for k, v in net.state_dict().items()} == dtypes
        assert torch.equal(net(X), out)  # still runs, the same
    net.half()  # removed: the model is the user's again
    assert net[0].weight.dtype == torch.float16


def test_to_cpu_and_a_storage_move_keep_working_and_remove_restores_the_masters() -> None:
    net = _net()
    masters = dict(net.named_parameters())
    with torch.no_grad(), apply_policy(net, _pol({"0": "bf16", "4": "fp8"}),
                                       guard="fallback") as h:
        out = net(X)
        net.to("cpu")
        net.to(torch.device("cpu"), non_blocking=True)
        assert torch.equal(net(X), out)
        ptr = net[2].weight.data_ptr()
        net._apply(lambda t: t.clone())  # new storage for every tensor, as a device move
        assert net[2].weight.data_ptr() != ptr
        assert torch.equal(net(X), out)
        with pytest.warns(GuardWarning):  # the guard's re-run weights follow the model
            assert torch.isfinite(net(BIG)).all()
        clone = copy.deepcopy(net)
        clone.half()  # a copy is a plain model
    assert h.guard_stats()[RANGE].fallbacks == 1
    assert dict(net.named_parameters()) == masters
    assert all(p.dtype == torch.float32 for p in net.parameters())


def _cuda_reason() -> str:
    ok, why = capability("fp16", None, "cuda")
    return "" if ok else why


@pytest.mark.gpu
@pytest.mark.skipif(bool(_cuda_reason()), reason=_cuda_reason() or "fp16 on CUDA")
def test_a_model_moved_to_cuda_after_apply_runs_there_and_comes_back_there() -> None:
    net = _net()
    masters = dict(net.named_parameters())
    want_model = _net().cuda()
    with torch.no_grad(), apply_policy(want_model, _pol(), guard="fallback"):
        want = want_model(X.cuda())
        with pytest.warns(GuardWarning):
            want_big = want_model(BIG.cuda())
    with torch.no_grad(), apply_policy(net, _pol(), guard="fallback"):
        net.to("cuda")
        assert torch.equal(net(X.cuda()), want)
        with pytest.warns(GuardWarning):
            assert torch.equal(net(BIG.cuda()), want_big)
    assert dict(net.named_parameters()) == masters
    assert all(p.device.type == "cuda" and p.dtype == torch.float32
               for p in net.parameters())
