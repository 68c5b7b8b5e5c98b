# SPDX-License-Identifier: Apache-2.0
"""Which CI stage runs which Python test file, and why (docs/DEVELOPMENT.md, "Which stage runs
what"). scripts/test.sh, scripts/test-torch2.sh and scripts/sanitize.sh run pytest with
``--ci-stage=<stage>`` (conftest.py); GRADCOMP_CI_FULL=1 runs every file in every stage.

- ``newest``: the newest torch 2.x (.venv-torch2). Every file: the one stage that runs the whole
  suite.
- ``oldest``: Debian's torch 1.13 (.venv), the oldest supported. The files whose code path
  depends on the torch version: DDP and its comm-hook/GradBucket API, torch.distributed through
  gradcomp.torch._compat (process-group ranks, the group's timeout), the worker thread's use of
  torch's autograd engine and thread settings, optimizers, version gates (FSDP2, GradScaler),
  torch tensors handed to the extension (DLPack), the README's example as a 1.13 user runs it.
- ``asan``: the extension built with ASan+UBSan, on .venv (scripts/sanitize.sh). The files that
  cross the binding boundary with inputs of their own or exercise C++ state: hostile inputs,
  plans, codecs, checkpoints and resharding, the hooks under DDP, the analytics bindings; and
  every file of ``oldest``: this stage runs on the same torch 1.13, so when it runs
  scripts/test.sh leaves the ``oldest`` stage out (its files run here, against the sanitized
  build; the release build runs them on the newest torch). Not the training-accuracy and
  experiment runs (many steps through entry points the stage already reaches) nor the files
  that never call the extension. test_ci_stages.py checks that every
  entry point a test file reaches is reached by a file of this stage, and that every file that
  imports gradcomp._C itself is in it.
"""
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent

NEWEST, OLDEST, ASAN = "newest", "oldest", "asan"
STAGE_NAMES = (NEWEST, OLDEST, ASAN)
_ALL = frozenset(STAGE_NAMES)
_NEWEST_OLDEST = frozenset((NEWEST, OLDEST))
_NEWEST_ASAN = frozenset((NEWEST, ASAN))
_NEWEST_ONLY = frozenset((NEWEST,))

# file -> (stages, why). Every tests/python/test_*.py is here (test_ci_stages.py checks it).
STAGES = {
    # ---- every stage: torch-version dependent and crossing the binding / holding C++ state
    "test_auto_hook.py": (_ALL, "the auto hook under DDP; its measured choice and checkpoint "
                                "(C++ plan state)"),
    "test_cast_route.py": (_ALL, "fp16/bf16 hooks under DDP; casts cross the binding"),
    "test_ddp_hooks.py": (_ALL, "every hook under DDP, its statistics and checkpoint round trip"),
    "test_dropcompute_ddp.py": (_ALL, "DropCompute under DDP (version branch in "
                                      "gradcomp.torch.dropcompute); the C++ controller"),
    "test_driver_threads.py": (_ALL, "the worker thread's torch thread settings (version-dependent "
                                     "autograd engine); OpenMP kernels behind the binding"),
    "test_fsdp.py": (_ALL, "FSDP2 on torch 2.x and its refusal on torch 1.13 (a version gate); "
                           "shard plans and their checkpoints"),
    "test_gpu.py": (_ALL, "CUDA (skips without a GPU or a CUDA build): NCCL, GradScaler, "
                          "FSDP2 and checkpoints on the GPU"),
    "test_gpu_multirank.py": (_ALL, "CUDA (skips without a GPU or a CUDA build): several ranks "
                                    "on one device over gloo"),
    "test_hierarchy.py": (_ALL, "two-level plans under DDP; make_plan's hierarchy arguments"),
    "test_hook_hardening.py": (_ALL, "hooks' timeouts (the group timeout, read differently per "
                                     "torch version), hung and failing peers, bad options"),
    "test_hostile_inputs.py": (_ALL, "hostile arrays, payloads and states at every codec and "
                                     "plan; torch tensors through DLPack"),
    "test_live_load.py": (_ALL, "one rank loads a state from the other side of start_iter in a "
                                "live DDP job: the hook's agreement check, C++ state restored"),
    "test_nonfinite_ddp.py": (_ALL, "Inf/NaN steps under DDP and GradScaler; the plans' undo"),
    "test_onebit_adam.py": (_ALL, "1-bit Adam: torch's optimizer API and the hook's C++ state"),
    "test_overlap.py": (_ALL, "the hooks' overlap with backward under DDP"),
    "test_qsr_py.py": (_ALL, "the C++ QSR scheduler; Local SGD averaging over torch.distributed"),
    "test_diloco.py": (_ALL, "the outer step (DiLoCo), streaming fragments, round headers and "
                             "checkpoints against a NumPy reference"),
    "test_reshard.py": (_ALL, "checkpoints resharded to another world size (C++ reshard_state) "
                              "under DDP"),
    "test_restart.py": (_ALL, "bitwise resume from checkpoints of every plan's C++ state, DDP's "
                              "bucket regrouping"),
    "test_topk_py.py": (_ALL, "the codecs' bindings; torch fp16/bf16 tensors through DLPack"),
    "test_small_allreduce.py": (_ALL, "the driver's small allreduce as torch.distributed "
                                      "point-to-point pairs (the version's p2p API); PowerSGD's "
                                      "plan through it"),
    "test_latency.py": (_ALL, "the experiments' latency emulation: a process group written in "
                              "Python on torch 2.x (DDP and the hooks through it), refused on "
                              "1.13 (a version gate)"),
    # ---- every stage too: torch-version dependent; under ASan they add little but keep the
    # ---- asan stage a superset of oldest (scripts/test.sh runs oldest only without sanitizers)
    "test_default_buckets.py": (_ALL, "DDP's default buckets on gloo (torch's own hook behaves "
                                      "differently per version)"),
    "test_powersgd_vs_torch.py": (_ALL, "our PowerSGD hook against torch's, which changes with "
                                        "torch; a training comparison"),
    "test_readme_example.py": (_ALL, "the README's DDP example as a user of either torch runs it"),
    "test_torchrun_recipe.py": (_ALL, "docs/MULTI_GPU.md's torchrun lines as a user of either "
                                      "torch runs them: torchrun and DDP differ by version "
                                      "(1.13 on Python 3.11 needs --redirects/--tee)"),
    # ---- newest and asan: version-independent, crossing the binding
    "test_ci_stages.py": (_NEWEST_ASAN, "this assignment; it reads the extension's entry points"),
    "test_bench_cli.py": (_NEWEST_ASAN, "python -m gradcomp.bench, bad input at the command line"),
    "test_docstring_examples.py": (_NEWEST_ASAN, "every docstring example of the extension runs"),
    "test_dropcompute_py.py": (_NEWEST_ASAN, "the DropCompute analytics' bindings and bad input"),
    "test_layering.py": (_NEWEST_ASAN, "include graph (sources only); the extension's name tables"),
    "test_fsdp_hostile.py": (_NEWEST_ASAN, "FSDP2 used as a hostile user would (torch 2.x; "
                                           "skips on 1.13); it restores C++ state "
                                           "(load_state_dict), which the asan stage must hold"),
    "test_make_plan_py.py": (_NEWEST_ASAN, "make_plan / make_shard_plan options and every plan's "
                                           "contract"),
    # ---- newest only
    "test_bench_summary.py": (_NEWEST_ONLY, "bench/summarize.py on committed JSON; no torch "
                                            "dependence, no extension"),
    "test_experiment.py": (_NEWEST_ONLY, "the experiment's machinery, tiny runs; library code "
                                         "paths are the other files'"),
    "test_scale_model.py": (_NEWEST_ASAN, "the scale model: its traffic from dry runs of every "
                                          "family's plans in the extension"),
    "test_doc_links.py": (_NEWEST_ONLY, "the documents' relative links and anchors: no torch"),
    "test_options_doc.py": (_NEWEST_ONLY, "docs/OPTIONS.md against its generator: the option "
                                          "tables and signatures it reads are the same on every "
                                          "torch; the entry points are test_make_plan_py.py's"),
    "test_training_accuracy.py": (_NEWEST_ONLY, "Fashion-MNIST/ViT accuracy against plain DDP: "
                                                "minutes of training through entry points the "
                                                "other files reach"),
    "test_wheel_contents.py": (_NEWEST_ONLY, "what the wheel ships (pyproject, the package's "
                                             "files and imports, the installed package): no "
                                             "torch, no extension call"),
}


# Seconds each file of the asan stage took under ASan, alone on this 2-core machine (CI record,
# 2026-11-28). Used only to split the stage into shards of about equal time (--ci-shard: CI runs
# two, one in each lane of scripts/test.sh); a stale figure costs balance, never a file.
ASAN_SECONDS = {
    "test_nonfinite_ddp.py": 58, "test_restart.py": 48, "test_reshard.py": 39,
    "test_ddp_hooks.py": 35, "test_auto_hook.py": 27, "test_hook_hardening.py": 26,
    "test_default_buckets.py": 26, "test_hostile_inputs.py": 24, "test_bench_cli.py": 19,
    "test_torchrun_recipe.py": 17,
}
DEFAULT_SECONDS = 3.0  # the other files: 59 s among 20 files in that run


def shard(files, index: int, count: int):
    """Shard `index` (1-based) of `count` of `files`: the longest first, each to the shard with
    the least time so far (ASAN_SECONDS). Every file is in exactly one shard."""
    if not 1 <= index <= count:
        raise ValueError(f"shard {index} of {count}: the index must be in 1..{count}")
    load = [0.0] * count
    out = [[] for _ in range(count)]
    for f in sorted(files, key=lambda f: (-ASAN_SECONDS.get(f, DEFAULT_SECONDS), f)):
        i = min(range(count), key=lambda j: (load[j], j))
        out[i].append(f)
        load[i] += ASAN_SECONDS.get(f, DEFAULT_SECONDS)
    return sorted(out[index - 1])


def parse_shard(text: str):
    """"I/N" -> (I, N), 1 <= I <= N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--ci-shard takes I/N (for example 1/2), got {text!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"--ci-shard {text}: I must be in 1..N")
    return i, n


def full_run() -> bool:
    """GRADCOMP_CI_FULL=1: every stage runs every file (for releases)."""
    return os.environ.get("GRADCOMP_CI_FULL", "0") not in ("", "0")


def is_test_file(name: str) -> bool:
    return name.startswith("test_") and name.endswith(".py")


def test_files():
    """Every test file of tests/python, sorted."""
    return sorted(p.name for p in HERE.iterdir() if p.is_file() and is_test_file(p.name))


def unassigned_files():
    return [f for f in test_files() if f not in STAGES]


def files_of(stage: str):
    return [f for f in test_files() if f in STAGES and stage in STAGES[f][0]]
