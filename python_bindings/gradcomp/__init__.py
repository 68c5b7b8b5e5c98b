# SPDX-License-Identifier: Apache-2.0
"""gradcomp: gradient compression and straggler mitigation for data-parallel training.

``import gradcomp`` needs only NumPy; the PyTorch integration lives in ``gradcomp.torch`` and
imports torch when it is used.
"""
from gradcomp._C import (  # noqa: F401
    Payload,
    RandomKCompressor,
    TopKCompressor,
    built_with_cuda,
    cpu_threads,
    cuda_device_count,
    set_cpu_threads,
    topk_indices,
)

from gradcomp import dropcompute  # noqa: E402,F401  (needs no torch)

__version__ = "0.1.0"
