"""The benchmark suite: every script, the question it answers, the group it belongs to and
its toy-size arguments (what ``python -m benchmarks run NAME --toy`` and the smoke test run).

A script that is not in ``BENCHMARKS`` fails ``tests/benchmarks/test_smoke.py``: a new
benchmark says here what it answers and how it runs small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the groups, in the order ``python -m benchmarks list`` prints them
GROUPS = {
    "estimate": "does the price hold? estimates set beside what was measured",
    "deploy": "deployment plans beside the one-liners a user writes instead",
    "train": "training plans: the whole step, its loss, its recipes",
    "tune": "what a tune costs and how its search compares",
    "scale": "models larger than memory: streamed, priced at full depth",
    "export": "a plan leaving autoprec, and the guard that runs with it",
    "gpu": "timed on a lent GPU (skipped without one)",
}


@dataclass(frozen=True)
class Benchmark:
    """One script: ``python -m benchmarks.<name>``."""

    group: str
    question: str
    #: toy-size arguments ({tmp}: a temporary folder); None: not run by the smoke test
    toy: list[str] | None = field(default=None)
    #: why ``toy`` is None (tested elsewhere, or writes into the checkout by design)
    untested_because: str = ""
    #: a line the toy run prints
    prints: str = "| "
    #: seconds the toy run may take
    timeout_s: int = 900
    #: an extra package the script needs beyond the dev extra
    needs: str = ""
    #: exit 1 is a verdict (the estimate missed), not a crash
    verdict_exit: bool = False


_ELSEWHERE = "run at toy size by its own test in tests/"

BENCHMARKS: dict[str, Benchmark] = {
    # -- estimate ---------------------------------------------------------------------------
    "cost_model_cpu": Benchmark("estimate", "does the cost model rank policies as this CPU "
                                "runs them? (--profile re-measures the cpu profile)",
                                untested_because=_ELSEWHERE),
    "compile_cost": Benchmark("estimate", "does the compile-mode cost model price what "
                              "inductor runs?", ["--smoke", "--models", "mixed8"]),
    "estimate_accuracy": Benchmark("estimate", "every timed row of a CPU tune, estimated vs "
                                   "measured", ["--models", "trap", "--modes", "eager",
                                                "--trials", "2"], verdict_exit=True),
    "probe_correlation": Benchmark("estimate", "how good the probes' cheap end-to-end "
                                   "estimate is", ["--models", "mlp"], prints="rho est"),
    "blockscale_error": Benchmark("estimate", "per-layer error of per-tensor fp8 vs MXFP8 vs "
                                  "NVFP4 (emulated)", ["--models", "trap", "--out",
                                                       "{tmp}/blockscale_error.md"]),
    # -- deploy -----------------------------------------------------------------------------
    "run_all": Benchmark("deploy", "every example tuned for its budgets and targets, beside "
                         "one global autocast (writes policies/)",
                         ["--quick", "--models", "trap", "--trials", "2", "--out-dir",
                          "{tmp}/out", "--policies", "{tmp}/policies", "--cache-dir",
                          "{tmp}/cache"]),
    "deploy_form": Benchmark("deploy", "the deploy form against model.to(torch.bfloat16)",
                             ["--part", "h100", "--trials", "2", "--out", "{tmp}"],
                             timeout_s=2400),
    "cpu_measured": Benchmark("deploy", "tuned for this CPU and measured on it, against fp32 "
                              "and one autocast", ["--models", "mixed8", "--trials", "2",
                                                   "--out", "{tmp}"]),
    "compile_winners": Benchmark("deploy", "eager vs compiled: does tuning for torch.compile "
                                 "pick another plan?", ["--models", "mixed8", "--trials", "2",
                                                        "--rounds", "1", "--inner", "1"],
                                 timeout_s=2400),
    "b200_formats": Benchmark("deploy", "a B200 tune with MXFP8 / NVFP4 in the search, beside "
                              "the uniform choices",
                              untested_because="writes its policies into policies/ by design"),
    "every_rule_runs": Benchmark("deploy", "does every rule run on torch.nn's own transformer "
                                 "blocks?", ["--out", "{tmp}"]),
    "vision_zoo": Benchmark("deploy", "torchvision and timm models through the whole flow: "
                            "tune, apply, audit in every mode",
                            ["--only", "torchvision ResNet-18", "--trials", "2"],
                            needs="torchvision"),
    # -- train ------------------------------------------------------------------------------
    "train_step_priced": Benchmark("train", "a training step priced on the H100 and B200 "
                                   "profiles: one-liners, fp8, the tuned plan",
                                   untested_because=_ELSEWHERE),
    "train_step_tuned": Benchmark("train", "the tuned training plan of train_step_priced",
                                  untested_because=_ELSEWHERE),
    "train_step_cpu": Benchmark("train", "training steps measured on this CPU against the "
                                "step's estimate: time and peak memory",
                                untested_because=_ELSEWHERE),
    "train_digits": Benchmark("train", "a CNN trained under a tuned fp16 policy, with and "
                              "without loss scaling", untested_because=_ELSEWHERE),
    "loss_parity": Benchmark("train", "does a training plan train as well as fp32? MiniLM "
                             "masked-LM eval loss beside bf16 autocast",
                             ["--policy", "benchmarks/results/minilm_mlm-h100-train.yaml",
                              "--steps", "2", "--rows", "2", "--seq-len", "16",
                              "--eval-every", "1", "--out", "{tmp}"]),
    "recipes_priced": Benchmark("train", "the fixed training recipes (torchtitan MXFP8 / NVFP4 "
                                "+ bf16 tail, Megatron first/last bf16, torchao's auto filter) "
                                "priced as steps on Llama-3 8B and 70B (shape-only), H100 and "
                                "B200, beside torchtitan's measured ratios", ["--toy"],
                                prints="| nvfp4 + bf16 tail (torchtitan) | "),
    "nvfp4_training": Benchmark("train", "NVFP4 training (emulated): MiniLM fine-tuned as a "
                                "masked LM, fp32 / bf16 / NVFP4 everywhere / NVFP4 + bf16 "
                                "tail, eval-loss gaps", ["--toy", "--out", "{tmp}"],
                                prints="| NVFP4 + bf16 tail |"),
    "fsdp2_plan": Benchmark("train", "a training plan under FSDP2 on 2 gloo ranks against one "
                            "process: loss per step, memory per rank",
                            ["--steps", "2", "--out", "{tmp}/fsdp2_plan.md"]),
    # -- tune -------------------------------------------------------------------------------
    "tune_baselines": Benchmark("tune", "tune against greedy, bisection, random search and "
                                "the exhaustive optimum", untested_because=_ELSEWHERE),
    "tune_depth": Benchmark("tune", "tuning time against depth",
                            ["--blocks", "1", "--budgets", "0.01"]),
    "tune_size": Benchmark("tune", "peak memory and time of a tune against model size",
                           ["--llama", "2", "--no-gpt2"]),
    "tune_time_train": Benchmark("tune", "what a training tune costs, stage by stage",
                                 untested_because=_ELSEWHERE),
    "workers_scaling": Benchmark("tune", "trials per minute with 1, 2 and 4 workers on one "
                                 "PostgreSQL study",
                                 untested_because="needs a PostgreSQL server it starts itself; "
                                 "the shared-study tests cover the storage"),
    # -- scale ------------------------------------------------------------------------------
    "make_llama_checkpoint": Benchmark("scale", "writes a random-weight Llama checkpoint "
                                       "(tiny, 1.1b, 3b, 8b) shard by shard, for the runs "
                                       "below", untested_because=_ELSEWHERE),
    "stream_memory": Benchmark("scale", "what a streamed tune of a 1.1-70 B Llama budgets "
                               "(resident, block, activations), from shapes alone",
                               ["--presets", "1.1b", "--tokens", "64"]),
    "tune_streamed": Benchmark("scale", "a checkpoint folder tuned streamed block by block: "
                               "peak RSS, wall, stage times, seconds per block",
                               untested_because=_ELSEWHERE),
    # -- export -----------------------------------------------------------------------------
    "export_sizes": Benchmark("export", "a plan saved as a compressed-tensors checkpoint and "
                              "loaded back with transformers", untested_because=_ELSEWHERE),
    "apply_overhead": Benchmark("export", "what applying a policy costs over one global "
                                "autocast", untested_because=_ELSEWHERE),
    "guard_cost": Benchmark("export", "what the run-time overflow guard costs", ["--smoke"]),
    # -- gpu --------------------------------------------------------------------------------
    "gpu_latency": Benchmark("gpu", "measured vs estimated latency on a GPU",
                             untested_because=_ELSEWHERE),
    "gpu_policies": Benchmark("gpu", "the committed policies' measured speed-up on a GPU",
                              untested_because=_ELSEWHERE),
    "gpu_train_step": Benchmark("gpu", "real training steps on the GPU at hand: fp32, one "
                                "global autocast, torchao fp8 and autoprec's plans",
                                untested_because=_ELSEWHERE),
}

#: modules of benchmarks/ that are not benchmarks
SUPPORT = {"__init__", "__main__", "common", "registry", "tables"}
