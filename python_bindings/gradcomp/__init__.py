# SPDX-License-Identifier: Apache-2.0
"""gradcomp: gradient compression and straggler mitigation for data-parallel training.

``import gradcomp`` needs only NumPy; the PyTorch integration lives in ``gradcomp.torch`` and
imports torch when it is used. Every public class and function of the extension is here under
``gradcomp.<name>``: the compressors, the allreduce plans (built by ``make_plan(name, ...)``), PowerSGD, and the DropCompute / QSR
analytics (also grouped in ``gradcomp.dropcompute`` with the helpers written in Python).
"""
from gradcomp._C import (  # noqa: F401
    BucketPlan,
    CastAllreducePlan,
    CastRoute,
    Collective,
    DenseAllreducePlan,
    DType,
    OneBitAllreducePlan,
    OneBitCompressor,
    OneBitScaling,
    OnNonFinite,
    Orthogonalization,
    Payload,
    Plan,
    PowerSGDPlan,
    PowerSGDState,
    RandomKAllreducePlan,
    RandomKCompressor,
    SelectMethod,
    TopKAllreducePlan,
    TopKCompressor,
    TopKExchange,
    TopKRoute,
    built_with_cuda,
    cpu_threads,
    cuda_device_count,
    make_plan,
    plan_defaults,
    plan_is_stateful,
    plan_names,
    set_cpu_threads,
    topk_indices,
)

from gradcomp import dropcompute  # noqa: E402,F401  (needs no torch)
from gradcomp.dropcompute import *  # noqa: E402,F401,F403  (the straggler and QSR analytics)

__version__ = "0.1.0"

__all__ = [
    "BucketPlan", "CastAllreducePlan", "CastRoute", "Collective", "DType", "OneBitScaling",
    "OnNonFinite", "Orthogonalization", "SelectMethod", "TopKExchange", "TopKRoute", "DenseAllreducePlan", "OneBitAllreducePlan",
    "OneBitCompressor", "Payload", "Plan", "PowerSGDPlan", "PowerSGDState", "RandomKAllreducePlan",
    "RandomKCompressor", "TopKAllreducePlan", "TopKCompressor", "built_with_cuda", "cpu_threads",
    "cuda_device_count", "make_plan", "plan_defaults", "plan_is_stateful", "plan_names",
    "set_cpu_threads", "topk_indices", "dropcompute",
] + dropcompute.__all__
