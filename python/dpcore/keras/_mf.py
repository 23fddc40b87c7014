"""The plan of matrix-factorization noise for the Keras path: the participation schema, the
steps and the strategy a :class:`~dpcore.keras.DPModel` trains with (shared by the model and
:func:`~dpcore.keras.make_private`)."""

from __future__ import annotations

import math
from typing import Any

from .._validate import count


def _mf_config(
    noise_mechanism: str, *, strategy: Any, epochs: Any, participation: Any, batch_size: Any, population_size: Any,
    sampling_probability: Any, expected_batch_size: Any, clipping: str,
) -> dict:
    """The plan of a DPModel with matrix-factorization noise: participation (max_participations
    = epochs), steps = epochs·b, strategy, the fixed denominator, n."""
    from ..matrix_factorization import NOISE_MECHANISMS, Participation, strategy_for

    if noise_mechanism not in NOISE_MECHANISMS:
        raise ValueError(f"noise_mechanism must be one of {NOISE_MECHANISMS} (or None for DP-SGD), got {noise_mechanism!r}")
    if clipping != "flat":
        raise ValueError("matrix-factorization noise supports flat clipping only")
    if epochs is None:
        raise TypeError(f"noise_mechanism={noise_mechanism!r} needs epochs= (the noise is planned for epochs × b steps)")
    epochs = count("epochs", epochs, 1)
    if population_size is None:
        raise TypeError("noise_mechanism needs population_size (the records cut into the cycle's batches)")
    n = count("population_size", population_size, 1)
    if sampling_probability is not None:
        raise ValueError("sampling_probability is for Poisson batches; with noise_mechanism give batch_size or participation")
    if participation is not None and not isinstance(participation, Participation):
        raise TypeError(f"participation must be a Participation, got {type(participation).__name__}")
    if participation is not None and participation.kind == "cyclic_poisson":
        if batch_size is not None:
            raise ValueError("batch_size has no role with cyclic Poisson sampling (the expected batch is p·n/b)")
        b = participation.min_separation
        if b > n:
            raise ValueError(f"participation has {b} groups but population_size is {n}")
        p = float(participation.sampling_probability)  # type: ignore[arg-type]
        part, den = Participation(b, epochs, p), p * n / b
    else:
        if batch_size is None:
            if participation is None:
                raise TypeError("noise_mechanism needs batch_size (fixed batches) or participation")
            batch_size = n // participation.min_separation
        bs = count("batch_size", batch_size, 1)
        if bs > n:
            raise ValueError(f"batch_size {bs} is larger than population_size {n}: not even one fixed batch")
        b = n // bs
        if participation is not None and participation.min_separation != b:
            raise ValueError(
                f"participation declares {participation.min_separation} batches per epoch, but {n} records in batches "
                f"of {bs} make {b} (b = n // batch_size)"
            )
        part, den = Participation(b, epochs), float(bs)
    if expected_batch_size is not None and not math.isclose(float(expected_batch_size), den, rel_tol=1e-9):
        raise ValueError(f"expected_batch_size {expected_batch_size} differs from the cycle's batch ({den})")
    steps = epochs * b
    return {
        "participation": part, "steps": steps, "strategy": strategy_for(noise_mechanism, part, steps, strategy),
        "denominator": den, "population_size": n,
    }
