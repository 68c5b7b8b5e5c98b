# SPDX-License-Identifier: Apache-2.0
"""End-to-end experiments (training on real data with the DDP hooks)."""
