"""The search space on hand-made inputs: choices, reasons, keys, rules, groups, locks."""

from __future__ import annotations

import numpy as np

from autoprec.formats.precisions import PRECISIONS
from autoprec.search.space import REGION, build_space, group_key


def _space(**kw):
    layers = ["a", "b", "c"]
    allowed = {"a": ["fp32", "bf16", "fp16", "fp8"], "b": ["fp32", "bf16", "fp16"],
               "c": ["fp32", "bf16", "fp16", "fp8"]}
    excluded = {"a": {"fp16": "fp16: overflow, max|y| 2.2e5 > 65504"},
                "b": {"fp8": "fp8: in_features 100 not a multiple of 16"}}
    return build_space(layers, allowed, excluded, ["fp32", "bf16", "fp16", "fp8"], **kw)


def _key(*names: str) -> tuple[int, ...]:
    return tuple(PRECISIONS.index(n) for n in names)


def test_choices_drop_excluded_and_keep_reasons():
    sp = _space()
    a, b, c = sp.variables
    assert a.choices == ["fp32", "bf16", "fp8"]  # fp16 removed: overflow
    assert b.choices == ["fp32", "bf16", "fp16"]
    assert c.choices == ["fp32", "bf16", "fp16", "fp8"]
    assert "65504" in sp.reasons()["a"]
    assert "multiple of 16" in sp.reasons()["b"]


def test_the_default_region_is_a_variable_without_fp8():
    sp = _space()
    assert sp.all_variables[0].name == REGION
    assert sp.region.choices == ["fp32", "bf16", "fp16"]  # tf32 not asked for; fp8 is no region
    sp = _space(regions=["fp32", "tf32", "fp16"])
    assert sp.region.choices == ["fp32", "fp16"]  # tf32 was not among the precisions asked


def test_uniform_falls_back_to_the_nearest_more_precise_choice():
    sp = _space()
    assert sp.params(sp.uniform("fp16")) == {REGION: "fp16", "a": "bf16", "b": "fp16",
                                             "c": "fp16"}
    assert sp.params(sp.uniform("fp8")) == {REGION: "fp16", "a": "fp8", "b": "fp16",
                                            "c": "fp8"}


def test_a_key_is_an_explicit_rule_on_every_layer():
    sp = _space()
    key = _key("bf16", "fp8", "fp32", "bf16")
    assert sp.key(sp.params(key)) == key
    assert sp.rules(key) == ("bf16", {"a": "fp8", "b": "fp32", "c": "bf16"})


def test_codes_spread_a_key_over_its_rule_paths():
    layers = [f"h.{i}.{n}" for i in range(3) for n in ("q", "o")]
    allowed = {lay: ["fp32", "bf16"] for lay in layers}
    sp = build_space(layers, allowed, {}, ["fp32", "bf16"], max_variables=4, locked=["x"])
    assert sp.rule_paths == [*sp.layers, "x"]
    codes = sp.codes(np.array([_key("bf16", "bf16", "fp32")]))
    # default, the three q layers (bf16), the three o layers (fp32), x locked at fp32
    assert codes.tolist() == [[2, 2, 2, 2, 0, 0, 0, 0]]


def test_locked_layers_are_not_variables_and_stay_fp32():
    sp = _space(locked=["b"])
    assert [v.name for v in sp.variables] == ["a", "c"]
    default, rules = sp.rules(_key("bf16", "bf16", "fp16"))
    assert default == "bf16" and rules == {"a": "bf16", "c": "fp16", "b": "fp32"}


def test_repeated_blocks_are_grouped_above_the_variable_limit():
    layers = [f"h.{i}.{n}" for i in range(3) for n in ("q", "o")]
    allowed = {lay: ["fp32", "bf16"] for lay in layers}
    sp = build_space(layers, allowed, {}, ["fp32", "bf16"], max_variables=4)
    assert [v.name for v in sp.variables] == ["h.*.q", "h.*.o"]
    assert sp.variables[0].layers == ["h.0.q", "h.1.q", "h.2.q"]
    assert group_key("encoder.layer.11.attention.self.query") == "encoder.layer.*.attention.self.query"
    assert sp.rules(_key("fp32", "bf16", "fp32"))[1]["h.2.q"] == "bf16"
    assert sp.size == 2 * 2 * 2
