import os

from hypothesis import HealthCheck, settings

# CI runs on 2 shared cores: keep property tests thorough but bounded, and deterministic.
settings.register_profile(
    "dpcore",
    max_examples=int(os.environ.get("DPCORE_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("dpcore")
