"""Device profiles: the docs/overview.md table, capability reasons, files and calibration overrides."""

from __future__ import annotations

import pytest

from autoprec.cost import Calibration, get_profile, known_devices, load_calibration
from autoprec.errors import InputError

# docs/overview.md "Device profiles" (dense TFLOP/s; TB/s)
TABLE = {
    "h100": ({"fp32": 67, "tf32": 495, "bf16": 989, "fp16": 989, "fp8": 1979}, 3.35),
    "h200": ({"fp32": 67, "tf32": 495, "bf16": 989, "fp16": 989, "fp8": 1979}, 4.8),
    "a100": ({"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312, "fp8": None}, 2.0),
    "l4": ({"fp32": 30, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242}, 0.3),
    "t4": ({"fp32": 8.1, "tf32": None, "bf16": None, "fp16": 65, "fp8": None}, 0.32),
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_profiles_match_the_design_table_and_cite_sources(name):
    prof = get_profile(name)
    peaks, tbps = TABLE[name]
    for prec, tf in peaks.items():
        got = prof.peak_flops[prec]
        if tf is None:
            assert got is None
            ok, why = prof.supports(prec)
            assert not ok and why.startswith(f"{prec}: {name} has no {prec}")
        else:
            assert got == pytest.approx(tf * 1e12, rel=0.02)
            assert prof.supports(prec) == (True, "")
    assert prof.memory_bw == pytest.approx(tbps * 1e12)
    assert prof.launch_overhead_s == pytest.approx(5e-6)
    assert "datasheet" in prof.source and "nvidia.com" in prof.source


def test_cpu_profile_is_measured_and_lacks_tf32_and_fp8():
    cpu = get_profile("cpu")
    assert cpu.precisions == ("fp32", "bf16", "fp16")
    assert "measured" in cpu.source
    assert "tf32: cpu" in cpu.supports("tf32")[1]
    assert cpu.setup("bf16") > 0 and cpu.setup("fp32") == 0


def test_unknown_device_lists_known_ones():
    with pytest.raises(InputError, match="unknown target device 'gb300'.*a100, b200, cpu, h100"):
        get_profile("gb300")
    assert get_profile(" H100 ").name == "h100"
    assert {"h100", "h200", "a100", "l4", "t4", "b200", "cpu"} <= set(known_devices())


def test_block_scaled_formats_only_on_blackwell_with_the_reason():
    b200 = get_profile("b200")
    assert b200.peak("nvfp4") == 2 * b200.peak("mxfp8") == 2 * b200.peak("fp8")
    for name in ("h100", "a100", "t4", "cpu"):
        ok, why = get_profile(name).supports("mxfp8")
        assert not ok and ("SM >= 10.0" in why or "cpu has no" in why), (name, why)


def test_supports_rejects_unknown_precision():
    with pytest.raises(InputError, match="unknown precision"):
        get_profile("h100").supports("int8")


def test_calibration_file_overrides_factors(tmp_path):
    cal = Calibration(device="h200", efficiency={"bf16": 0.75, "fp8": 0.6},
                      memory_efficiency=0.9, launch_overhead_s=7e-6, n_samples=12,
                      rel_rmse=0.05, note="unit test")
    path = cal.save(tmp_path / "h200.calibration.yaml")
    back = load_calibration(path)
    assert back.efficiency == {"bf16": 0.75, "fp8": 0.6}
    assert back.launch_overhead_s == pytest.approx(7e-6)
    prof = get_profile("h200", calibration=path)
    assert prof.peak("bf16") == pytest.approx(989.4e12 * 0.75)
    assert prof.peak("fp32") == pytest.approx(67e12)  # not calibrated: datasheet
    assert prof.bandwidth == pytest.approx(4.8e12 * 0.9)
    assert prof.calibrated_from == str(path)
    with pytest.raises(InputError, match="calibration is for device 'h200'"):
        get_profile("h100", calibration=path)


def test_bad_files_are_input_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("autoprec_calibration: 1\ndevice: h100\nefficiency: {bf16: -1}\n")
    with pytest.raises(InputError, match="efficiency.bf16 > 0 must hold"):
        load_calibration(bad)
    bad.write_text("autoprec_calibration: 1\ndevice: h100\nefficiency: {int4: 0.5}\n")
    with pytest.raises(InputError, match="unknown precision 'int4'"):
        load_calibration(bad)
    bad.write_text("schema: 1\ndevices: {x: {peak_tflops: {fp32: 1}, memory_tbps: 1}}\n")
    with pytest.raises(InputError, match="missing 'launch_overhead_us'"):
        get_profile("x", profiles_file=bad)
    bad.write_text("foo: [")
    with pytest.raises(InputError, match="not valid YAML"):
        load_calibration(bad)
    with pytest.raises(InputError, match="cannot read"):
        load_calibration(tmp_path / "missing.yaml")


def test_custom_profiles_file(tmp_path):
    f = tmp_path / "devs.yaml"
    f.write_text("schema: 1\ndevices:\n  mygpu:\n    peak_tflops: {fp32: 10, bf16: 80}\n"
                 "    memory_tbps: 1.0\n    launch_overhead_us: 4\n")
    prof = get_profile("mygpu", profiles_file=f)
    assert prof.precisions == ("fp32", "bf16")
    ok, why = prof.supports("fp8")
    assert not ok and "mygpu has no fp8" in why
