# SPDX-License-Identifier: Apache-2.0
"""Accuracy regressions on a real dataset: each compressing hook trains the
Fashion-MNIST CNN on 2 gloo ranks at the learning rate plain DDP uses (SGD, lr 0.05, momentum
0.9 in the optimizer or, with momentum compression, in the hook) and must end within a margin of
plain DDP's test accuracy. Before the fix the 1-bit hook (one scale per server chunk) ended at
chance (10%); test_old_onebit_form_is_what_collapsed keeps that measurement, and
test_rotation_closes_most_of_the_onebit_gap the step from unrotated to rotated blocks.

Setting: 300 steps of 2 x 32 samples from 20k training images, 2k test images; fixed seed and
data order, one thread per rank: two runs on 2026-11-24 gave identical figures (plain gave 87.45%
on 2026-11-23 at an earlier commit, so margins leave room for such shifts). Measured on the 2-core machine
(torch 1.13, 2026-11-24): plain 86.00%; fp16 85.50, bf16 85.85, top-k 0.1% 86.30; 1-bit with the
hook's defaults (block 128, L2 scale) 80.85, with momentum compression 82.40; the old 1-bit form
(one L1 scale per chunk) 10.70; random-k with every tensor sampled (before small tensors were sent whole) 10%
with momentum correction 68.00, without 52.85;
random-k 1% 10.00 with and 10.70 without correction; PowerSGD rank 4 86.30 and top-k with DGC's
warm-up 86.60 (torch 1.13, 2026-11-24 later). On torch 2.15 (same day): plain 87.00%,
fp16 87.25, bf16 86.60, top-k 86.35, 1-bit 79.20 / 83.40 (momentum compression), old 1-bit form
9.65, random-k 10% 59.10 with and 10.15 without correction, 1% non-finite. With rotated 1-bit
blocks (the hook's default; c8ccb73, 2026-11-25, same setting): 1-bit 86.75% / 86.15% with
momentum compression on torch 1.13, 85.80% / 86.30% on torch 2.15 (gaps -0.75 / -0.15 and 1.20
/ 0.70; unrotated the momentum form gave 82.40 and 83.40 at that commit too). Margins: 4 points
for every hook (about 2x the largest gap seen on 2026-11-23, 1.75 points, and 3x 1-bit's largest,
1.20; a full epoch on 4 ranks is level with plain DDP on average,
experiments/results/fashion_mnist_onebit_rotation_2026-11-24.md). Random-k with the small tensors
sent whole (dense_below = 32768, the default now; 2026-11-25): 1% with momentum
correction 87.40% and 10% 85.80% against plain 86.90% on torch 1.13, 87.05% and 85.90% against
87.00% on torch 2.15; every tensor sampled (dense_below=0, before the fix) 1% ended at 9.60% on
torch 1.13 and stopped on a non-finite gradient on torch 2.15. 4-bit quant, which on these 2 ranks
takes its one-round gather route (the default there since 5206f75; 2026-12-01): 86.85% against
plain 86.90% on torch 1.13, 86.65% against 87.00% on torch 2.15. A collapse (76 points) fails
every margin; test_old_randomk_form_is_what_diverged keeps the divergence of the old form."""
import functools
import os

import pytest

torch = pytest.importorskip("torch")

import ci_stages  # noqa: E402  (tests/python: GRADCOMP_CI_FULL)
from experiments import fashion_mnist as fm  # noqa: E402

STEPS = 300
# FSDP2 (torch 2.x), 4-bit gradients and int8 weights against FSDP2's own collectives, this
# setting on 2026-11-26 (831e70e, torch 2.15): 86.55% vs 87.00% (-0.45). One epoch on 4 ranks gave
# -0.76 to +0.88 points per seed between 4-bit settings and FSDP2
# (experiments/results/2026-11-26-fashion-mnist-fsdp/NOTES.md); 2 points is 2.6x the largest, and
# a collapse fails it.
FSDP_MARGIN = 2.0
MARGIN = {"onebit:momentum=0.9": 4.0, "onebit": 4.0, "fp16": 4.0, "bf16": 4.0, "topk": 4.0,
          "topk-dgc": 4.0, "powersgd": 4.0, "randomk-mc": 4.0, "randomk10-mc": 4.0,
          "quant4": 4.0}  # points


@functools.lru_cache(maxsize=None)  # each configuration trains once per session
def _run(cfg: str, seed: int = 0):
    args = dict(config=cfg, seed=seed, lr=0.05, momentum=0.9, batch=32, epochs=1, steps=STEPS,
                model="cnn", train_subset=20000, test_subset=2000, log_every=50)
    return fm.run_config(args, world=2)


@pytest.fixture(scope="module")
def plain():
    return _run("plain")


# Runs that repeat what another run here covers, and the measurements of past forms below, run
# only in full runs (GRADCOMP_CI_FULL=1, for releases): each costs half a minute of CI (40 s
# beside the sanitizer lane; the eight runs of this test were half of the torch 2.x stage,
# 2026-11-28). bf16 is fp16's plan with another rounding (its rounding has unit tests against a
# reference); random-k at 10% is the 1% run's code at another density; 1-bit without momentum
# compression is the momentum run's plan and codec with the momentum in the optimizer instead
# of the hook; top-k with DGC's warm-up is the top-k run's plan with a density schedule over
# the first steps (the schedule has unit tests: tests/topk, test_topk_py.py).
release_only = pytest.mark.skipif(
    not ci_stages.full_run(), reason="a variant or a past form, trained only in full runs "
                                     "(GRADCOMP_CI_FULL=1): CI time; the default forms run here")
# quant4 on these 2 ranks runs quant's default there, the one-round gather route
REGULAR = ("onebit:momentum=0.9", "fp16", "topk", "powersgd", "randomk-mc", "quant4")


@pytest.mark.parametrize("cfg", [c if c in REGULAR else pytest.param(c, marks=release_only)
                                 for c in sorted(MARGIN)])
def test_hook_accuracy_within_margin_of_plain_ddp(plain, cfg):
    r = _run(cfg)
    print(f"\n{cfg}: {100 * r['accuracy']:.2f}% vs plain {100 * plain['accuracy']:.2f}% "
          f"after {r['steps']} steps, bytes/step {r['bytes_sent_per_step']}")
    assert plain["accuracy"] > 0.70, f"plain DDP itself did not train: {plain['accuracy']}"
    assert r["steps"] == STEPS
    assert 100 * r["accuracy"] >= 100 * plain["accuracy"] - MARGIN[cfg], \
        f"{cfg}: {100 * r['accuracy']:.2f}% vs plain {100 * plain['accuracy']:.2f}%"


def _has_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except (ImportError, ValueError):  # torch 1.13's fsdp package fails on Python 3.11
        return False
    return hasattr(FSDPModule, "set_custom_reduce_scatter")


@pytest.mark.skipif(not _has_fsdp2(),
                    reason=f"FSDP2 custom collectives need torch 2.x (this is {torch.__version__})")
def test_sharded_quantized_training_within_margin_of_fsdp2(plain):
    """FSDP2 with 4-bit gradients and int8 weights (compress_fsdp) against the uncompressed
    run, same seed and data: within FSDP_MARGIN points, and 7x fewer gradient bytes. The
    uncompressed run is plain DDP's: FSDP2 with its own collectives ends on the same loss, to the
    last bit (0.40441823422908785, 86.55% both, torch 2.15, 2026-11-28), so training it as well
    only repeated that run (70 s of CI); GRADCOMP_CI_FULL=1 trains it and checks the identity."""
    ref, ours = plain, _run("fsdp-quant4-int8")
    if ci_stages.full_run():
        fsdp = _run("fsdp")
        assert fsdp["final_loss"] == plain["final_loss"], (fsdp["final_loss"], plain["final_loss"])
    print(f"\nfsdp-quant4-int8: {100 * ours['accuracy']:.2f}% vs uncompressed "
          f"{100 * ref['accuracy']:.2f}%")
    assert ours["accuracy"] >= ref["accuracy"] - FSDP_MARGIN / 100
    t = ours["fsdp_totals"]
    assert t["reduce_scatter"]["dense_wire_bytes"] > 7 * t["reduce_scatter"]["wire_bytes"]


# The measurements of past failures of the compression itself (which the torch version does not
# change): they keep the reason for a default, not a code path of it, and run in full runs only.


@release_only
def test_old_onebit_form_is_what_collapsed():
    """Why the 1-bit plan keeps per-block scales: one scale per server chunk (block_size=0) without
    momentum compression ends near chance in the same setting; the fix is what makes the
    difference, not the setting."""
    r = _run("onebit:block_size=0;scaling=sign_l1;rotate=false")
    print(f"\nonebit block_size=0, sign_l1: {100 * r['accuracy']:.2f}%")
    assert r["accuracy"] < 0.5


@release_only
def test_rotation_closes_most_of_the_onebit_gap():
    """The 1-bit hook's remaining gap before rotation: unrotated blocks (sign + one scale of a heavy-tailed block)
    trailed plain DDP by 3.6 points here; the rotation is what brings the hook within the margin
    above (measured 3.75 points better on torch 1.13, 2.90 on torch 2.15)."""
    rotated = _run("onebit:momentum=0.9")
    unrotated = _run("onebit:momentum=0.9;rotate=false")
    print(f"\nonebit momentum: rotated {100 * rotated['accuracy']:.2f}%, unrotated "
          f"{100 * unrotated['accuracy']:.2f}%")
    assert rotated["bytes_sent_per_step"] == unrotated["bytes_sent_per_step"]
    assert 100 * rotated["accuracy"] >= 100 * unrotated["accuracy"] + 1.0


@release_only
def test_old_randomk_form_is_what_diverged():
    """Why random-k sends small tensors whole: random-k 1% with momentum correction but every tensor
    sampled (dense_below=0, the form before the fix) diverges in the same setting: it ends at
    chance (torch 1.13) or its gradients become non-finite and check_finite stops it (torch
    2.15). Sending the small tensors whole (the default) is what makes it train (above)."""
    try:
        acc = _run("randomk:ratio=0.01;momentum=0.9;dense_below=0")["accuracy"]
    except Exception as e:  # raised by a rank: the hook's finiteness check stopped training
        if "non-finite" not in str(e):
            raise
        acc = None
    print("\nrandomk 1%, dense_below=0: "
          + ("non-finite gradients" if acc is None else f"{100 * acc:.2f}%"))
    assert acc is None or acc < 0.3


# ---- a transformer with AdamW ---------------------------------------------------------------
# The ViT of the AdamW experiment, 2 ranks, 150 steps (about a sixth of an epoch). Measured on
# torch 2.15 at 0c92d5b (2026-11-27): plain AdamW 74.10%, 1-bit Adam 74.00%. The full run (4
# ranks, one epoch, two seeds; experiments/results/2026-11-27-fashion-mnist-vit-adamw) put 1-bit
# Adam 0.40 points below AdamW with the freeze after 30% of the steps and 0.90 after 15%; the
# margin, 2 points, is 2x the latter. The form that diverged (the compressed momentum divided by
# sqrt(v) afterwards) left the loss non-finite within two steps of the freeze, and one that
# never trained stays near 10%: either fails. VIT_PLAIN_MIN: 9 points under plain's measurement.
VIT_STEPS = 150
VIT_PLAIN_MIN = 0.65
VIT_MARGIN = 2.0  # points


@functools.lru_cache(maxsize=None)
def _vit(cfg: str):
    args = dict(config=cfg, seed=0, lr=1e-3, momentum=0.0, batch=32, epochs=1, steps=VIT_STEPS,
                model="vit", train_subset=20000, test_subset=2000, log_every=50,
                optimizer="adamw", weight_decay=0.05, warmup_steps=8)
    return fm.run_config(args, world=2)


@pytest.mark.skipif(int(torch.__version__.split(".")[0]) < 2,
                    reason="the ViT runs on the newest torch only (CI time); the optimizer and "
                           "hook pair runs on torch 1.13 in test_onebit_adam.py")
def test_vit_with_adamw_and_one_bit_adam_within_margin():
    """The ViT of the AdamW experiment (1.2M parameters) on 2 ranks for VIT_STEPS steps: plain
    AdamW trains (VIT_PLAIN_MIN), and 1-bit Adam (the variance frozen after 30% of the steps,
    the momentum exchanged at 1 bit per element) ends within VIT_MARGIN points of it with 20x
    fewer wire bytes after the freeze."""
    plain, ours = _vit("plain"), _vit("onebit:adam=0.3")
    print(f"\nViT AdamW: plain {100 * plain['accuracy']:.2f}%, 1-bit Adam "
          f"{100 * ours['accuracy']:.2f}%")
    assert plain["accuracy"] > VIT_PLAIN_MIN
    assert 100 * ours["accuracy"] >= 100 * plain["accuracy"] - VIT_MARGIN
    wire = [w for _, _, _, w in ours["steps_log"]]
    freeze = ours["freeze_step"]
    assert freeze == int(0.3 * VIT_STEPS)
    assert min(wire[:freeze]) > 20 * max(wire[freeze + 1:])


# ---- the IDX loader ------------------------------------------------------------------------
def _write(path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)


def test_idx_loader_reads_and_rejects_bad_files(tmp_path):
    import struct

    import numpy as np

    good = struct.pack(">HBBIII", 0, 8, 3, 2, 28, 28) + bytes(range(256)) * 6 + bytes(32)
    _write(tmp_path / "ok", good)
    a = fm.load_idx(str(tmp_path / "ok"))
    assert a.shape == (2, 28, 28) and a.dtype == np.uint8 and a[0, 0, 5] == 5
    _write(tmp_path / "trunc", good[:-1])
    with pytest.raises(ValueError, match="truncated"):
        fm.load_idx(str(tmp_path / "trunc"))
    _write(tmp_path / "long", good + b"\0")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        fm.load_idx(str(tmp_path / "long"))
    _write(tmp_path / "magic", b"\x01" + good[1:])
    with pytest.raises(ValueError, match="not an unsigned-byte IDX"):
        fm.load_idx(str(tmp_path / "magic"))
    _write(tmp_path / "short", b"\0\0")
    with pytest.raises(ValueError, match="too short"):
        fm.load_idx(str(tmp_path / "short"))
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        fm.load_idx(str(tmp_path / "missing"))


def test_split_rejects_mismatched_labels(tmp_path):
    import gzip
    import struct

    imgs = struct.pack(">HBBIII", 0, 8, 3, 3, 28, 28) + bytes(3 * 784)
    labs = struct.pack(">HBBI", 0, 8, 1, 2) + bytes(2)
    for name, data in [("t10k-images-idx3-ubyte", imgs), ("t10k-labels-idx1-ubyte", labs)]:
        with gzip.open(tmp_path / (name + ".gz"), "wb") as f:
            f.write(data)
    with pytest.raises(ValueError, match="3 images but labels"):
        fm.load_split("test", str(tmp_path))


def test_dataset_is_installed():
    """CI installs Debian's dataset-fashion-mnist (scripts/apt-packages.txt)."""
    x, y = fm.load_split("test")
    assert x.shape == (10000, 1, 28, 28) and y.shape == (10000,)
    assert abs(float(x.mean())) < 0.1  # normalised
    assert os.path.isdir(fm.DEFAULT_DIR)
