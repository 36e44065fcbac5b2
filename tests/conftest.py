"""Shared pytest setup: keep hypothesis quick and deterministic on CI's two cores."""

import os

# Liger-Kernel's triton kernels run on CPU tensors through triton's interpreter
# (tests/test_features_vs_libraries.py): set before anything imports triton
os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
