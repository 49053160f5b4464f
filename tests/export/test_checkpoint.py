"""The deployed plan as a compressed-tensors checkpoint, read back by the real loaders:
transformers' ``from_pretrained`` (outputs within the plan's lowest format's rounding) and
compressed-tensors' own decompressors (every weight as autoprec stores it)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

from autoprec.apply.apply import apply_policy  # noqa: E402
from autoprec.export import ExportRefused, keep_islands, save_pretrained  # noqa: E402
from autoprec.formats.precisions import FORMATS  # noqa: E402
from autoprec.lower.stored import dequantized_weight  # noqa: E402
from autoprec.policy import Policy  # noqa: E402
from autoprec.workload.loading import load_model_file  # noqa: E402
from tests.helpers import MODELS  # noqa: E402

L = "model.layers"


def _spec():
    return load_model_file(MODELS / "tiny_llama.py")


def _rules(i: int, names: tuple[str, ...], prec: str, part: str) -> dict[str, str]:
    return {f"{L}.{i}.{part}.{n}": prec for n in names}


QKV = ("q_proj", "k_proj", "v_proj")
GU = ("gate_proj", "up_proj")


def _policy(layers: dict[str, str]) -> Policy:
    return Policy(default="bf16", form="deploy", layers=layers)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _planned(model: torch.nn.Module, policy: Policy, batch: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad(), apply_policy(model, policy, fp8_backend="emulated",
                                           form="deploy"):
            return model(input_ids=batch).logits.float()


def _load(out: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out).eval()


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    got: dict[str, torch.Tensor] = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(str(f)))
    return got


MIXED = {**_rules(0, QKV, "fp8", "self_attn"), **_rules(0, GU, "fp8", "mlp"),
         f"{L}.1.mlp.down_proj": "fp32"}


def test_fp8_bf16_and_an_island_round_trip_through_from_pretrained(tmp_path: Path) -> None:
    spec = _spec()
    model, batches = spec.model(), spec.calibration_batches()
    pol = _policy(MIXED)
    planned = _planned(model, pol, batches[0])
    rep = save_pretrained(model, pol, tmp_path, calibration=batches, forward=spec.forward)

    cfg = json.loads((tmp_path / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and cfg["dtype"] == "bfloat16"
    (group,) = q["config_groups"].values()
    assert sorted(group["targets"]) == sorted(p for p, v in MIXED.items() if v == "fp8")
    assert group["weights"]["strategy"] == "tensor" and group["weights"]["num_bits"] == 8
    assert group["input_activations"]["dynamic"] is True
    assert group["input_activations"]["strategy"] == "tensor"
    assert f"{L}.1.mlp.down_proj" in q["ignore"] and "lm_head" in q["ignore"]
    assert not set(q["ignore"]) & set(group["targets"])

    st = _tensors(tmp_path)
    assert st[f"{L}.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert st[f"{L}.0.self_attn.q_proj.weight_scale"].dtype == torch.float32
    assert st[f"{L}.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert st[f"{L}.1.mlp.down_proj.weight"].dtype == torch.float32  # the island
    assert rep.islands == {f"{L}.1.mlp.down_proj": "float32"}
    assert rep.islands_note is not None and "down_proj" in rep.islands_note
    # bytes on disk against the plan's weights: the same tensors plus a header
    assert abs(rep.disk_bytes - rep.plan_bytes) / rep.plan_bytes < 0.05

    loaded = _load(tmp_path)
    keep_islands(loaded, tmp_path)
    assert loaded.get_submodule(f"{L}.1.mlp.down_proj").weight.dtype == torch.float32
    with torch.no_grad():
        got = loaded(input_ids=batches[0]).logits
    fp32 = spec.model()(input_ids=batches[0]).logits.detach()
    # within the plan's lowest format's rounding (fp8's unit roundoff), and far closer to
    # the plan than the plan is to fp32 would allow by chance
    assert _rel(got, planned) < FORMATS["fp8"].eps
    assert _rel(got, planned) < _rel(planned, fp32)


def test_compressed_tensors_reads_every_scheme_back(tmp_path: Path) -> None:
    """fp8, mxfp8 and nvfp4 groups: compressed-tensors' own decompressor gives each layer's
    weight as autoprec's deploy form stores it (dequantised)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    spec = _spec()
    model, batches = spec.model(), spec.calibration_batches()
    layers = {**_rules(0, QKV, "fp8", "self_attn"), **_rules(0, GU, "mxfp8", "mlp"),
              **_rules(1, GU, "nvfp4", "mlp")}
    pol = _policy(layers)
    rep = save_pretrained(model, pol, tmp_path, calibration=batches, forward=spec.forward)
    assert set(rep.groups) == {"fp8", "mxfp8", "nvfp4"}
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "mixed-precision"
    qc = QuantizationConfig.model_validate(cfg)
    formats = {}
    for scheme in qc.config_groups.values():
        for t in scheme.targets:
            formats[t] = scheme
    assert {formats[p].format for p in layers} == {"float-quantized", "mxfp8-quantized",
                                                  "nvfp4-pack-quantized"}
    st = _tensors(tmp_path)
    assert st[f"{L}.1.mlp.up_proj.weight_packed"].dtype == torch.uint8
    assert st[f"{L}.1.mlp.up_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert st[f"{L}.0.mlp.up_proj.weight_scale"].dtype == torch.uint8  # E8M0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_policy(model, pol, fp8_backend="emulated", form="deploy")
    try:
        mods = dict(model.named_modules())
        for path, fmt in layers.items():
            scheme = formats[path]
            comp = BaseCompressor.get_value_from_registry(scheme.format)
            own = {k[len(path) + 1:]: v for k, v in st.items() if k.startswith(path + ".")}
            back = comp.decompress(own, scheme)["weight"].float()
            want = dequantized_weight(mods[path], fmt)
            if fmt != "nvfp4":
                torch.testing.assert_close(back, want, rtol=1e-6, atol=0, msg=path)
                continue
            # compressed-tensors decompresses NVFP4 into bf16 (unpack_fp4_from_uint8's
            # default): within bf16's rounding; the stored codes and scales are exact
            torch.testing.assert_close(back, want, rtol=FORMATS["bf16"].eps, atol=0,
                                       msg=path)
            from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

            from autoprec.formats.elements import e2m1_values

            n, k = want.shape
            codes = unpack_fp4_from_uint8(own["weight_packed"], n, k, dtype=torch.float32)
            assert torch.equal(codes, e2m1_values(mods[path].weight)), path
            assert torch.equal(own["weight_scale"].float(),
                               mods[path].weight_scale.float()), path
    finally:
        handle.remove()


def test_a_fused_group_with_mixed_schemes_is_refused(tmp_path: Path) -> None:
    spec = _spec()
    pol = _policy({f"{L}.0.self_attn.q_proj": "fp8"})  # k, v stay bf16
    with pytest.raises(ExportRefused, match=r"q_proj: fp8.*k_proj: bf16"):
        save_pretrained(spec.model(), pol, tmp_path, calibration=spec.calibration_batches(),
                        forward=spec.forward)
    assert not (tmp_path / "config.json").exists()


def test_a_plain_module_is_refused() -> None:
    from autoprec.errors import InputError

    with pytest.raises(InputError, match="PreTrainedModel"):
        save_pretrained(torch.nn.Linear(32, 32), Policy(default="bf16"), "unused")


@pytest.mark.parametrize("where", ["proc", "file"])
def test_an_out_that_cannot_be_a_folder_is_refused_before_any_work(
        where: str, tmp_path: Path) -> None:
    """One OutputError naming the argument and the path, not an OSError after the export."""
    from autoprec.errors import OutputError

    taken = tmp_path / "model.py"
    taken.write_text("keep me\n")
    out = Path("/proc/ck") if where == "proc" else taken
    with pytest.raises(OutputError, match=rf"^save_pretrained: out {out}: ") as info:
        save_pretrained(torch.nn.Linear(32, 32), Policy(default="bf16"), out)
    assert "PreTrainedModel" not in str(info.value)  # refused before the model is read
    assert taken.read_text() == "keep me\n"


def test_a_save_into_an_earlier_saves_folder_replaces_its_weight_files(tmp_path: Path) -> None:
    """An earlier save's shards and index go (the user's other files stay): left beside the
    new single file, transformers would read stale shards through their index or a glob."""
    from safetensors.torch import save_file

    spec = _spec()
    out = tmp_path / "ckpt"
    out.mkdir()
    stale = {"model-00001-of-00002.safetensors": {"x": torch.zeros(3)},
             "model-00002-of-00002.safetensors": {"y": torch.ones(2)}}
    for name, tensors in stale.items():
        save_file(tensors, str(out / name))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"x": "model-00001-of-00002.safetensors",
                                        "y": "model-00002-of-00002.safetensors"}}))
    (out / "NOTES.md").write_text("mine")
    rep = save_pretrained(spec.model(), _policy({f"{L}.0.mlp.down_proj": "fp8"}), out,
                          calibration=spec.calibration_batches(), forward=spec.forward)
    assert rep.replaced == sorted([*stale, "model.safetensors.index.json"])
    names = sorted(f.name for f in out.iterdir())
    assert "NOTES.md" in names and not any(n.startswith(".autoprec-replaced") for n in names)
    assert not set(stale) & set(names)
    assert "x" not in _tensors(out) and "y" not in _tensors(out)
    _load(out)  # transformers reads the new save


def test_the_earlier_weight_files_come_back_when_the_write_fails(tmp_path: Path) -> None:
    from autoprec.export.checkpoint import _replacing_weights

    (tmp_path / "model.safetensors").write_bytes(b"old")
    with pytest.raises(OSError), _replacing_weights(tmp_path) as replaced:
        assert replaced == ["model.safetensors"]
        assert not (tmp_path / "model.safetensors").exists()  # set aside while writing
        (tmp_path / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")
    assert (tmp_path / "model.safetensors").read_bytes() == b"old"
    assert [f.name for f in tmp_path.iterdir()] == ["model.safetensors"]
