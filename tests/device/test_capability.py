

def test_the_cpu_16bit_note_follows_the_features() -> None:
    from autoprec.device.capability import cpu_16bit_note

    assert "faster than fp32" in cpu_16bit_note("bf16", frozenset({"amx_bf16", "avx512_bf16"}))
    assert "slower than fp32" in cpu_16bit_note("bf16", frozenset({"avx512_bf16"}))
    assert "~60x" in cpu_16bit_note("bf16", frozenset({"avx2"}))
    assert "faster" in cpu_16bit_note("fp16", frozenset({"amx_fp16"}))
    assert cpu_16bit_note("fp16", frozenset({"amx_bf16"})) != cpu_16bit_note(
        "bf16", frozenset({"amx_bf16"}))
