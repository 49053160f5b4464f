"""A checkpoint folder streamed block by block computes what the loaded model computes.

A tiny bf16 Llama saved by ``save_pretrained`` in small shards (several files, an index)
is opened twice: loaded whole by transformers (``from_pretrained``) and streamed by
autoprec (``stream.open_streamed``: blocks on ``meta`` until they run). Outputs, plans'
outputs and audits, probe rows and the written policy must be identical, not close.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from autoprec.lower.wide16 import scoring_gemms
from autoprec.policy.schema import Policy
from autoprec.pricing.target import resolve_target
from autoprec.probe import probe
from autoprec.stream import find_blocks, open_streamed
from autoprec.tuning.memory import streamed_need
from autoprec.workload.checkpoint_spec import checkpoint_spec
from autoprec.workload.hashing import weights_hash
from tests.helpers import run_cli

#: deploy-form plans of a bf16 model: uniform, mixed with an fp8 leaf and fp32 / fp16
#: islands on a block, and an fp16 default with an fp32 attention.
PLANS = [
    Policy(default="bf16", form="deploy"),
    Policy(default="bf16", form="deploy", layers={"model.layers.1.mlp.down_proj": "fp8",
                                                  "model.layers.2": "fp32", "lm_head": "fp16"}),
    Policy(default="fp16", form="deploy", layers={"model.layers.0.self_attn": "fp32",
                                                  "model.layers.1.mlp": "fp8"}),
]


def write_checkpoint(folder: Path, layers: int = 3, seed: int = 0) -> Path:
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
    return folder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-llama")


def loaded(folder: Path, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    model.config.use_cache = False
    return model


def test_checkpoint_is_sharded(ckpt: Path) -> None:
    shards = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) >= 3


def test_plain_forward_is_the_loaded_models(ckpt: Path) -> None:
    ref, s = loaded(ckpt), open_streamed(ckpt)
    path, blocks = find_blocks(s)
    assert path == "model.layers" and len(blocks) == 3
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ref(input_ids=x).logits, s(input_ids=x).logits)
    st = s.autoprec_stream
    assert st.loads == 3  # each block read once, and back on meta after it ran
    assert all(p.device.type == "meta" for p in blocks.parameters())
    assert s.lm_head.weight.device.type == "cpu"  # resident
    mem = st.memory
    assert mem.largest_block.startswith("model.layers.") and mem.blocks == 3
    block = sum(p.numel() * 2 for p in ref.model.layers[0].parameters())
    assert mem.largest_block_bytes == block
    assert mem.resident_bytes == sum(p.numel() * 2 for p in ref.parameters()) - 3 * block
    # the budget: a plan may hold an fp32 copy (2x bf16) of a block and of the largest
    # resident module beside them (the fp32 row stores them in fp32)
    assert mem.largest_resident in ("lm_head", "model.embed_tokens")
    assert mem.largest_resident_bytes == ref.lm_head.weight.numel() * 2 and mem.widen == 2.0
    need, resident, act, _ = streamed_need(st, 64)
    assert need == resident + block + 2 * (block + mem.largest_resident_bytes) + act
    assert open_streamed(ckpt, torch.float32).autoprec_stream.memory.widen == 1.0  # masters


@pytest.mark.parametrize("plan", range(len(PLANS)))
def test_plan_streamed_equals_plan_applied(ckpt: Path, plan: int) -> None:
    pol = PLANS[plan]
    ref, s = loaded(ckpt), open_streamed(ckpt)
    target = resolve_target("h100")
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    outs, audits = [], []
    for m in (ref, s):
        with torch.no_grad(), scoring_gemms(), target.apply(m, pol):
            outs.append(m(input_ids=x).logits)
        with pytest.warns(Warning):  # the hand-written plan has no fingerprint
            audits.append(target.audit(m, pol, lambda m=m: m(input_ids=x)))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], ref(input_ids=x).logits) or plan == 0
    a, b = audits
    assert a.errors == b.errors == []
    assert {r.layer: r.to_dict() for r in a.rows} == {r.layer: r.to_dict() for r in b.rows}
    assert len(a.rows) == len(b.rows) > 20
    assert all(p.device.type == "meta" for p in s.model.layers.parameters())
    assert all(p.dtype == torch.bfloat16 for p in s.model.layers.parameters())  # restored


def test_a_plan_installs_and_runs_each_resident_module_once_per_forward(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embeddings run in block 0's shell and are replayed in the later shells and the
    tail; the LM head, once a forward has shown it runs after the blocks, is quantised for
    the tail alone (an 8 B Llama's head is 1 GB: each extra install held another copy)."""
    import autoprec.apply.stored as stored

    s, ref = open_streamed(ckpt), loaded(ckpt)
    heads: list[torch.nn.Module] = []
    real = stored.stored_weight

    def counted(mod: torch.nn.Module, fmt: str, backend: str) -> Any:
        heads.append(mod)
        return real(mod, fmt, backend)

    monkeypatch.setattr(stored, "stored_weight", counted)
    embeds: list[int] = []
    s.model.embed_tokens.register_forward_hook(lambda *a: embeds.append(1))
    pol = Policy(default="bf16", form="deploy", layers={"lm_head": "fp8",
                                                        "model.layers.1.mlp.down_proj": "fp8"})
    target = resolve_target("h100")
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    for forward in range(2):
        heads.clear()
        embeds.clear()
        with torch.no_grad(), scoring_gemms(), target.apply(s, pol):
            out = s(input_ids=x).logits
        assert sum(m is s.lm_head for m in heads) == (2 if forward == 0 else 1)
        assert len(embeds) == 1
    with torch.no_grad(), scoring_gemms(), target.apply(ref, pol):
        assert torch.equal(out, ref(input_ids=x).logits)


def test_plans_differing_from_a_block_on_replay_the_blocks_before(ckpt: Path) -> None:
    """Plans of one form and default on the same inputs compute the blocks before their
    first rule alike: the streamed model keeps those outputs and starts each later plan at
    its first rule's block, with the numbers of the loaded model under each plan."""
    s, ref = open_streamed(ckpt), loaded(ckpt)
    st = s.autoprec_stream
    target = resolve_target("h100")
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    plans = [  # first rule in block 2, 1, 2, none (LM head only) twice, another default
        Policy(default="bf16", form="deploy", layers={"model.layers.2.mlp.down_proj": "fp8"}),
        Policy(default="bf16", form="deploy", layers={"model.layers.1.self_attn": "fp32",
                                                      "lm_head": "fp8"}),
        Policy(default="bf16", form="deploy", layers={"model.layers.2.mlp": "fp16"}),
        Policy(default="bf16", form="deploy", layers={"lm_head": "fp16"}),
        Policy(default="bf16", form="deploy", layers={"lm_head": "fp8"}),
        Policy(default="fp16", form="deploy", layers={"model.layers.2.mlp": "fp8"}),
    ]
    replayed = []
    for pol in plans:
        before = st.replayed
        with torch.no_grad(), scoring_gemms():
            with target.apply(s, pol):
                got = s(input_ids=x).logits
            with target.apply(ref, pol):
                want = ref(input_ids=x).logits
        assert torch.equal(got, want), pol.layers
        replayed.append(st.replayed - before)
    # 1st: nothing kept; 2nd: block 0 kept by the 1st; 3rd: blocks 0-1 (kept by the 1st
    # and 2nd); 4th: the same two (no plan before computed block 2 as given: the 4th
    # does and keeps it); 5th: all three (the LM head runs after the blocks: a plan's
    # first forward showed it); 6th: another default, nothing kept for it
    assert replayed == [0, 1, 2, 2, 3, 0]
    with torch.no_grad(), scoring_gemms():  # a plain forward is not a plan's: computed whole
        loads = st.loads
        assert torch.equal(s(input_ids=x).logits, ref(input_ids=x).logits)
        assert st.loads == loads + 3


def test_end_to_end_probes_replay_the_blocks_before_their_layer(ckpt: Path) -> None:
    spec = checkpoint_spec(ckpt, seq_len=32)
    batches = spec.calibration_batches()
    s = open_streamed(ckpt)
    layers = ["model.layers.0.mlp.down_proj", "model.layers.2.mlp.down_proj",
              "model.layers.1.self_attn.o_proj"]
    tables = [probe(m, batches, precisions=["fp8"], progress=False, e2e=layers)
              for m in (loaded(ckpt), s)]
    a, b = (t.to_frame() for t in tables)
    assert a.equals(b)
    assert b["e2e_error"].notna().sum() == 3
    # run deepest first: block 2's run keeps blocks 0-1, block 1's replays block 0
    assert s.autoprec_stream.replayed == len(batches) * (0 + 1 + 0)


def test_probe_rows_identical(ckpt: Path) -> None:
    spec = checkpoint_spec(ckpt, seq_len=32)
    batches = spec.calibration_batches()
    tables = [probe(m, batches, precisions=["fp16", "fp8"], progress=False, e2e="all")
              for m in (loaded(ckpt), open_streamed(ckpt))]
    a, b = (t.to_frame() for t in tables)
    assert len(a) > 20
    assert a.equals(b)


def test_weights_hash_reads_headers_not_weights(ckpt: Path, tmp_path: Path) -> None:
    s = open_streamed(ckpt)
    h = weights_hash(s)
    assert h == weights_hash(open_streamed(ckpt))
    assert all(p.device.type == "meta" for p in s.model.layers.parameters())
    other = write_checkpoint(tmp_path / "other", seed=1)
    assert weights_hash(open_streamed(other)) != h
    shard = sorted(other.glob("*.safetensors"))[0]
    before = weights_hash(open_streamed(other))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert weights_hash(open_streamed(other)) != before  # a rewritten shard is new weights


def test_block_that_does_not_fit_is_refused_in_one_line(
        ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["tune", ckpt, "--target", "h100", "--no-track",
                              "--memory-limit", "0.0001", "--out", tmp_path / "p.yaml"], capsys)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert "largest block (model.layers." in line and "do not fit in 0.00 GB" in line
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1
    assert not (tmp_path / "p.yaml").exists()


def test_folder_without_config_is_one_line(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(["tune", tmp_path / "empty", "--no-track"], capsys)
    assert code == 2 and "checkpoint folder (with a config.json)" in err


def test_calibration_is_real_text(ckpt: Path) -> None:
    spec = checkpoint_spec(ckpt)
    (cal,), (held,) = spec.calibration_batches(), spec.eval_batches()
    assert cal["input_ids"].shape == (1, 64)
    text = bytes(int(i) for i in cal["input_ids"][0]).decode("utf-8", "replace")
    assert "JSON" in text or "json" in text  # json's docstring, bytes mod a 256 vocabulary
    assert not torch.equal(cal["input_ids"], held["input_ids"])


def _without_provenance(path: Path) -> str:
    """The policy file's text with its provenance block (timestamps, study, versions) cut."""
    import yaml

    data = yaml.safe_load(path.read_text())
    data.pop("provenance", None)
    return yaml.safe_dump(data, sort_keys=True)


@pytest.mark.slow
def test_streamed_tune_writes_the_in_memory_policy(ckpt: Path, tmp_path: Path) -> None:
    import dataclasses

    import autoprec

    spec = checkpoint_spec(ckpt)  # the defaults the folder's own tune uses
    in_memory = dataclasses.replace(spec, build_model=lambda: loaded(ckpt))
    opts = {"target": "h100", "max_error": 0.02, "trials": 8, "progress": False}
    streamed = autoprec.tune(str(ckpt), out=tmp_path / "s" / "p.yaml", **opts)
    held = autoprec.tune(in_memory, out=tmp_path / "m" / "p.yaml", **opts)
    a, b = (tmp_path / d / "p.yaml" for d in ("s", "m"))
    assert _without_provenance(a) == _without_provenance(b)
    assert "provenance" in a.read_text()
    assert streamed.policy.layers == held.policy.layers
    assert streamed.costs.stage_seconds.keys() == held.costs.stage_seconds.keys()


def test_backward_does_not_keep_the_blocks_weights(ckpt: Path) -> None:
    """A forward with gradients keeps no block's weights: the backward reads them back from
    the shards, and the input gradients are the loaded model's."""
    import weakref

    ref, s = loaded(ckpt), open_streamed(ckpt)
    st = s.autoprec_stream
    alive: list[weakref.ref[torch.Tensor]] = []
    st.listeners.append(lambda old, new: alive.append(weakref.ref(new))
                        if new.device.type != "meta" else None)
    x = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    grads = []
    for m in (ref, s):
        emb = m.model.embed_tokens(x).detach().requires_grad_(True)  # (B, T, C)
        out = m(inputs_embeds=emb).logits
        if m is s:
            assert len(alive) == 27 and all(r() is None for r in alive)  # 3 blocks x 9
        out.float().pow(2).sum().backward()
        grads.append(emb.grad)
    assert st.reloads >= 3 * 7  # every GEMM weight read back for the input's gradient
    assert torch.equal(grads[0], grads[1])


def test_the_trace_holds_one_blocks_weights_and_exports_as_the_loaded_model(
        ckpt: Path) -> None:
    """Non-strict torch.export runs the forward on fake tensors: a block loaded then is
    fake too (shapes, no weights). Loaded for real, export captured every block's weights
    as constants until it ended (the 8 B in fp32 masters: killed for memory at 23 GB)."""
    import weakref

    from autoprec.trace import trace

    s = open_streamed(ckpt, torch.float32)
    st = s.autoprec_stream
    alive: list[weakref.ref[torch.Tensor]] = []
    st.listeners.append(lambda old, new: alive.append(weakref.ref(new))
                        if new.device.type != "meta" else None)
    most = [0]

    def on_block(i: int, n: int) -> None:
        most[0] = max(most[0], sum(r() is not None for r in alive))

    st.on_block = on_block
    batch = {"input_ids": torch.randint(0, 256, (1, 16))}
    fwd = lambda m, b: m(**b).logits  # noqa: E731
    got = trace(s, batch, forward=fwd)
    want = trace(loaded(ckpt, torch.float32), batch, forward=fwd)
    assert got.tracer == want.tracer == "export"
    assert got.to_json() == want.to_json()
    assert most[0] <= 9  # one block's 9 weights, whichever forward


def test_under_autocast_the_backward_keeps_no_bf16_copy_of_the_blocks_weights(
        ckpt: Path) -> None:
    """A training plan runs autocast over fp32 masters: a GEMM saves autocast's bf16 copy
    of the weight, not the weight. Those copies are read back and cast again for the
    backward (an 8 B's were 16 GB held until it ran); the gradients are the loaded model's."""
    ref, s = loaded(ckpt, torch.float32), open_streamed(ckpt, torch.float32)
    st = s.autoprec_stream
    kept: list[str] = []
    pack = st._pack
    st._pack = lambda t: (kept.append(type(r := pack(t)).__name__), r)[1]  # type: ignore[method-assign]
    x = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    grads = []
    for m in (ref, s):
        emb = m.model.embed_tokens(x).detach().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16):
            out = m(inputs_embeds=emb).logits
        out.float().pow(2).sum().backward()
        grads.append(emb.grad)
    # per block: each GEMM's bf16 weight copy (7) and the two norms' fp32 weights
    assert kept.count("_SavedWeight") == 3 * 9
    assert st.reloads == 3 * 9 and not st._casts
    assert torch.equal(grads[0], grads[1])


@pytest.mark.slow
def test_a_training_tune_of_a_bf16_checkpoint_holds_fp32_masters(ckpt: Path,
                                                                 tmp_path: Path) -> None:
    """``--form train`` on a bf16 folder: the blocks stream in fp32 (the trainer's masters,
    initialised from the stored bf16), and the policy is the one the same model loaded
    whole in fp32 gets."""
    import dataclasses

    import autoprec
    from autoprec.workload.checkpoint_spec import load_model

    net = load_model(ckpt, masters=True).model()
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    st = net.autoprec_stream
    st.load_block(0)
    assert net.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    assert st.memory.largest_block_bytes == 2 * open_streamed(ckpt).autoprec_stream.memory \
        .largest_block_bytes  # held in fp32: twice the stored bf16

    spec = checkpoint_spec(ckpt, masters=True)
    fp32 = dataclasses.replace(spec, build_model=lambda: loaded(ckpt, torch.float32))
    opts = {"target": "b200", "form": "train", "max_error": 0.02, "trials": 6,
            "progress": False}
    streamed = autoprec.tune(str(ckpt), out=tmp_path / "s" / "p.yaml", **opts)
    autoprec.tune(fp32, out=tmp_path / "m" / "p.yaml", **opts)
    assert streamed.policy.form == "train" and not streamed.policy.reference  # fp32 reference
    a, b = (tmp_path / d / "p.yaml" for d in ("s", "m"))
    assert _without_provenance(a) == _without_provenance(b)
    # check and evaluate hold the folder in fp32 under the training plan, as the tune did
    gate = autoprec.check(str(ckpt), a)
    assert gate.passed, gate.reasons
    assert autoprec.evaluate(str(ckpt), a).error == gate.error


def _cuda_reason() -> str:
    from autoprec.device.capability import capability

    ok, why = capability("bf16", None, "cuda")
    return "" if ok else why


def test_the_folder_streams_onto_the_device_it_is_given(ckpt: Path) -> None:
    """``device``: the resident parts, the buffers and each loaded block go there; the
    checkpoint spec's batches too (default: the GPU where there is one)."""
    s = open_streamed(ckpt, device="cpu")
    assert s.lm_head.weight.device.type == "cpu"
    spec = checkpoint_spec(ckpt, device="cpu")
    assert spec.calibration_batches()[0]["input_ids"].device.type == "cpu"
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert checkpoint_spec(ckpt).eval_batches()[0]["input_ids"].device.type == want


@pytest.mark.gpu
@pytest.mark.skipif(bool(_cuda_reason()), reason=_cuda_reason() or "bf16 on CUDA")
def test_a_folder_streamed_on_the_gpu_holds_one_block_there(ckpt: Path) -> None:
    """On a GPU: the plain forward and a plan's are the loaded model's on that GPU, and
    the GPU never holds more than the resident parts and about one block."""
    ref = loaded(ckpt).cuda()
    s = open_streamed(ckpt, device="cuda")
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)).cuda()
    mem = s.autoprec_stream.memory
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = s(input_ids=x).logits
    assert torch.cuda.max_memory_allocated() - base < 3 * mem.largest_block_bytes + (1 << 22)
    with torch.no_grad():
        assert torch.equal(ref(input_ids=x).logits, out)
    pol = PLANS[1]
    target = resolve_target("h100")
    outs = []
    for m in (ref, s):
        with torch.no_grad(), scoring_gemms(), target.apply(m, pol):
            outs.append(m(input_ids=x).logits)
    assert torch.equal(outs[0], outs[1])


#: the forward of the probe-resume test: counts its calls, raises KeyboardInterrupt (a
#: Ctrl-C) at call ``STOP_AT`` (0: never)
CALLS = {"n": 0, "stop_at": 0}


def _counting_forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    CALLS["n"] += 1
    if CALLS["n"] == CALLS["stop_at"]:
        raise KeyboardInterrupt
    return model(**batch).logits


def test_a_killed_streamed_probe_resumes_after_its_last_finished_stage(ckpt: Path,
                                                                        tmp_path: Path) -> None:
    """Ctrl-C in the end-to-end runs: the shadow pass and the finished runs were kept, the
    next probe runs only what is left, and its table is the uninterrupted one's."""
    spec = checkpoint_spec(ckpt, seq_len=32)
    batches = spec.calibration_batches()
    opts = {"precisions": ["fp16", "fp8"], "progress": False, "e2e": "all",
            "forward": _counting_forward}
    whole = probe(open_streamed(ckpt), batches, cache_dir=tmp_path / "a", **opts)
    runs = int(whole.meta["e2e_runs"])
    assert runs > 4
    # the trace (two forwards), the shadow pass (two: its capture and its run outside the
    # blocks, probe/blockwise.py), two runs, then Ctrl-C
    CALLS.update(n=0, stop_at=2 + 2 + 2 + 1)
    with pytest.raises(KeyboardInterrupt):
        probe(open_streamed(ckpt), batches, cache_dir=tmp_path / "b", **opts)
    kept = sorted(f.name.rsplit(".", 2)[1] for f in (tmp_path / "b").glob("*.pt"))
    assert kept == ["e2e", "shadow"]
    CALLS.update(n=0, stop_at=0)
    again = probe(open_streamed(ckpt), batches, cache_dir=tmp_path / "b", **opts)
    assert CALLS["n"] == 2 + runs - 2  # the trace; no shadow pass; two runs not run again
    assert again.to_frame().equals(whole.to_frame())
    assert not list((tmp_path / "b").glob("*.pt"))  # gone once the table is stored


def test_a_streamed_models_graph_is_kept_for_the_next_tune(ckpt: Path, tmp_path: Path) -> None:
    """The trace of a streamed model (three streamed forwards) is stored beside the probe
    cache and read back, equal, by the next tune's prepare."""
    from autoprec.tuning.prepare import _traced

    spec = checkpoint_spec(ckpt)
    batch = spec.calibration_batches()[0]
    first = _traced(spec.model(), spec, batch, tmp_path)
    assert [f.name.split("-")[0] for f in tmp_path.glob("*.pt")] == ["trace"]
    net = spec.model()
    loads = net.autoprec_stream.loads
    again = _traced(net, spec, batch, tmp_path)
    assert net.autoprec_stream.loads == loads  # no forward ran
    assert again.to_json() == first.to_json()
    assert len(again.ops.ops) == len(first.ops.ops) and again.fingerprint == first.fingerprint


def test_save_of_a_checkpoint_folder_writes_what_the_loaded_model_writes(
        ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``autoprec save DIR``: the folder is loaded whole by transformers (the deploy form
    rewrites every weight) and written as the same model loaded by hand would be."""
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file

    from autoprec.export import save_pretrained

    pol = Policy(default="bf16", form="deploy", layers={"model.layers.0.mlp": "fp8",
                                                        "model.layers.2.self_attn": "fp32"})
    pol_file = tmp_path / "p.yaml"
    pol_file.write_text(pol.dumps())
    code, out, err = run_cli(["save", ckpt, "--policy", pol_file, "--out", tmp_path / "cli"],
                             capsys, quiet_warnings=True)
    assert code == 0, err
    spec = checkpoint_spec(ckpt)
    save_pretrained(loaded(ckpt), pol, tmp_path / "hand", calibration=spec.calibration_batches())

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("*.safetensors")):
            got.update(load_file(str(f)))
        return got

    a, b = tensors(tmp_path / "cli"), tensors(tmp_path / "hand")
    assert a.keys() == b.keys() and len(a) > 20
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_bf16_plan_on_a_bf16_llama_is_the_model_as_given(ckpt: Path) -> None:
    """The deploy form keeps a 16-bit model's fp32 buffers (a Llama's rotary ``inv_freq``):
    a plan that is the model's own dtype everywhere computes exactly the plain forward
    (rounded to bf16, the angles moved the 8 B Llama's logits by 8.5 %)."""
    target = resolve_target("h100")
    x = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(4))
    for m in (loaded(ckpt), open_streamed(ckpt)):
        with torch.no_grad(), scoring_gemms():
            plain = m(input_ids=x).logits
            with target.apply(m, Policy(default="bf16", form="deploy")):
                assert m.model.rotary_emb.inv_freq.dtype == torch.float32
                planned = m(input_ids=x).logits
        assert torch.equal(plain, planned)


def test_a_model_offloaded_by_device_map_is_refused_naming_its_folder(
        ckpt: Path, tmp_path: Path) -> None:
    """transformers' ``device_map`` with disk offload (accelerate's hooks, weights on
    ``meta``): refused in one line that names the folder to tune instead (streamed)."""
    from autoprec.errors import ModelFileError
    from autoprec.workload.loading import check_has_data

    model = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.bfloat16, offload_folder=str(tmp_path / "off"),
        device_map={"model.embed_tokens": "cpu", "model.rotary_emb": "cpu",
                    "model.layers": "disk", "model.norm": "cpu", "lm_head": "cpu"})
    assert any(p.device.type == "meta" for p in model.parameters())
    with pytest.raises(ModelFileError, match=f"autoprec tune {ckpt}"):
        check_has_data(model, "tune: model")
