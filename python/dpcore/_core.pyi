# Type stubs for the Rust extension module dpcore._core (see rust/bindings/).
from typing import List, Optional, Tuple

import numpy as np
import numpy.typing as npt

__version__: str
__all__ = [
    "gaussian_sum_flat",
    "record_norms",
    "clip_sum_groups",
    "gaussian_release",
    "discrete_params",
    "discrete_gaussian_sum_flat",
    "clip_round_sum",
    "discrete_release",
    "part_sumsq",
    "gaussian_flat",
    "chacha_stream_words",
    "seed_key",
    "simd_tier",
    "poisson_sample",
    "fixed_size_sample",
    "ledger_scan",
    "mf_noise",
    "mf_unit_noise",
    "mf_advance",
    "mf_advance_and_draw",
    "pld_epsilon_bounds",
    "pld_delta_bounds",
    "pld_compose",
    "truncated_poisson_mixture",
    "rdp_poisson_subsampled_gaussian",
    "rdp_composition",
    "rdp_per_group",
    "epsilon_composition",
    "delta_composition",
    "epsilon_from_rdp",
    "calibrate_noise_multiplier",
    "calibrate_sampling_probability",
    "calibrate_steps",
    "_log_a_quadrature",
    "default_rdp_orders",
    "NOISE_CHUNK",
    "__version__",
]
NOISE_CHUNK: int

def gaussian_sum_flat(
    arrays: List[np.ndarray],
    l2_norm_clip: float,
    noise_multiplier: float,
    denominator: Optional[float] = None,
    seed: Optional[int] = None,
    scales: Optional[List[float]] = None,
    f64_out: bool = False,
) -> Tuple[List[np.ndarray], npt.NDArray[np.float64]]:
    """Noised clipped sum; returns flat arrays (reshaped by the Python layer) and the norms (NaN for
    a record with a NaN or infinite value, which adds zero to the sum)."""
def clip_sum_groups(
    arrays: List[np.ndarray],
    groups: List[int],
    clips: List[float],
    scales: Optional[List[float]] = None,
) -> Tuple[List[np.ndarray], npt.NDArray[np.float64]]:
    """Clipped sums of several groups in one pass over the records (no noise): array k belongs to
    group `groups[k]` (numbered 0, 1, … in array order) and group g is clipped to `clips[g]`.
    Returns one flat float64 sum per array and the norms, group-major (G·B values). A record with
    a NaN or infinite value in any group adds zero to every sum and has norm NaN in every group."""
def gaussian_release(
    sums: List[npt.NDArray[np.float64]],
    stddevs: List[float],
    denominators: List[float],
    f32_out: List[bool],
    seed: Optional[int] = None,
) -> List[np.ndarray]:
    """The Gaussian release of flat float64 sums: (sums[k] + N(0, stddevs[k]²)) / denominators[k],
    float32 where `f32_out[k]`, all parts in one parallel call."""
def discrete_params(
    l2_norm_clip: float, noise_multiplier: float, dim: int, granularity: Optional[float] = None, per_record: bool = True
) -> Tuple[float, int, int, int, float, float]:
    """The discrete Gaussian mechanism's parameters: (granularity, S, σ² numerator, σ² denominator,
    sensitivity after rounding, noise stddev), all fixed before any record is read."""
def discrete_gaussian_sum_flat(
    arrays: List[np.ndarray],
    l2_norm_clip: float,
    noise_multiplier: float,
    granularity: Optional[float] = None,
    denominator: Optional[float] = None,
    seed: Optional[int] = None,
    scales: Optional[List[float]] = None,
) -> Tuple[List[npt.NDArray[np.float64]], npt.NDArray[np.float64], Tuple[float, int, int, int, float, float]]:
    """Discrete Gaussian noised clipped sum (float64 outputs), the norms (NaN for a non-finite
    record, which adds zero), and the parameters."""
def clip_round_sum(
    arrays: List[np.ndarray], l2_norm_clip: float, granularity: float, sens_sq: int, scales: Optional[List[float]] = None
) -> Tuple[List[npt.NDArray[np.float64]], npt.NDArray[np.float64], int]:
    """Clipped records rounded onto the grid and summed exactly (grid units, float64), the norms,
    and how many records were rounded toward zero to meet the bound `sens_sq`. A non-finite
    record adds zero and has norm NaN."""
def discrete_release(
    sums: List[npt.NDArray[np.float64]],
    part_scales: List[float],
    l2_norm_clip: float,
    noise_multiplier: float,
    dim: int,
    granularity: float,
    per_record: bool,
    denominator: Optional[float] = None,
    seed: Optional[int] = None,
    round_sums: bool = False,
) -> List[npt.NDArray[np.float64]]:
    """The discrete Gaussian release of sums (one flat float64 array per part): grid units when
    `round_sums` is false, the records' units (rounded here) when true. The parameters are
    rebuilt from (l2_norm_clip, noise_multiplier, dim, granularity, per_record)."""
def record_norms(arrays: List[np.ndarray], scales: Optional[List[float]] = None) -> npt.NDArray[np.float64]:
    """The joint L2 norm of every record (parts divided by their scales), float64 of shape (B,);
    NaN for a record with a NaN or infinite value."""
def part_sumsq(arrays: List[np.ndarray], parallel: bool = True) -> List[npt.NDArray[np.float64]]:
    """Per array, the sum of squares of every record (float64 of shape (B,)), unscaled. Non-finite
    values give non-finite sums; the caller treats those records. `parallel=False` keeps the work on the
    calling thread."""
def gaussian_flat(n: int, stddev: float, double: bool, seed: Optional[int] = None, parallel: bool = True) -> np.ndarray:
    """`n` values of N(0, stddev²), flat; `parallel=False` keeps the work on the calling thread."""
def chacha_stream_words(key: bytes, part: int, chunk: int, n: int, start: int = 0) -> npt.NDArray[np.uint32]:
    """Words `[start, start + n)` (uint32) of the noise stream of chunk `chunk` of part `part` of
    the 32-byte `key`, in the order the core reads them: for checking the accelerator noise."""
def simd_tier() -> str:
    """The SIMD tier the kernels dispatch to on this CPU: "avx512", "avx2" or "baseline"."""
def seed_key(seed: int) -> bytes:
    """The 32-byte ChaCha20 key an integer `seed` stands for in every seeded call (tests and
    reproductions only: anyone who knows the seed knows the noise)."""
def mf_noise(
    kind: str,
    coefficients: List[float],
    theta: List[float],
    omega: List[float],
    state: np.ndarray,
    dim: int,
    step: int,
    stddev: float,
    sum: Optional[npt.NDArray[np.float64]] = None,
    denominator: float = 1.0,
    seed: Optional[int] = None,
    fresh: Optional[np.ndarray] = None,
    parallel: bool = True,
) -> np.ndarray:
    """Step `step` of a matrix-factorization mechanism's correlated noise: `(sum + stddev·(C⁻¹z)_step)
    / denominator` in the state's dtype, advancing `state` (dim × state values per coordinate) in place;
    `fresh`: z drawn ahead, in the state's dtype."""
def mf_unit_noise(
    kind: str,
    coefficients: List[float],
    theta: List[float],
    omega: List[float],
    state: np.ndarray,
    dim: int,
    step: int,
    seed: Optional[int] = None,
    fresh: Optional[np.ndarray] = None,
    parallel: bool = True,
) -> np.ndarray:
    """The unit noise (C⁻¹z)_step without advancing `state` (read only)."""
def mf_advance(
    kind: str,
    coefficients: List[float],
    theta: List[float],
    omega: List[float],
    state: np.ndarray,
    dim: int,
    step: int,
    w: np.ndarray,
    parallel: bool = True,
) -> None:
    """Advances `state` in place past step `step` with that step's unit noise `w`."""
def mf_advance_and_draw(
    kind: str,
    coefficients: List[float],
    theta: List[float],
    omega: List[float],
    state: np.ndarray,
    dim: int,
    step: int,
    w: np.ndarray,
    seed: Optional[int] = None,
    parallel: bool = True,
) -> np.ndarray:
    """`mf_advance` past step `step` with `w`, then the unit noise of step `step + 1` from the updated
    state, in one pass."""
def poisson_sample(n: int, q: float, seed: Optional[int] = None) -> npt.NDArray[np.uint64]:
    """Sorted indices of a Poisson sample (uint64)."""
def ledger_scan(
    data: bytes,
) -> Tuple[
    Optional[
        Tuple[int, int, Optional[str], List[Tuple[int, int, int, float, int, Optional[int], bool, bool, List[Tuple[float, float]]]]]
    ],
    int,
]:
    """The complete lines of a ledger file as runs of identical samples, or the first line the
    fast reader refuses (``(None, line)``; the Python reader then reads the file).
    Returns ``(lines, valid_bytes, privacy_unit, runs)``; a run is ``(first_sample, count,
    population_size, sampling_probability, policy index, sample_size, seeded, non_private,
    [(l2_norm_clip, stddev), ...])``."""
def fixed_size_sample(n: int, b: int, seed: Optional[int] = None) -> npt.NDArray[np.uint64]:
    """Sorted indices of a uniform sample of fixed size without replacement (uint64)."""

# Accounting (rust/bindings/accounting.rs). Groups are (q or m/n, noise_multiplier, count).
def rdp_poisson_subsampled_gaussian(q: float, z: float, orders: List[float]) -> npt.NDArray[np.float64]:
    """One step's RDP of the Poisson-subsampled Gaussian at each order."""
def rdp_composition(
    poisson: List[Tuple[float, float, float]],
    wor: List[Tuple[float, float, float]],
    non_private: bool,
    orders: List[float],
) -> npt.NDArray[np.float64]:
    """Total RDP of a composition at each order. `poisson`: (q, z, count); `wor`: (m/n, z, count)."""
def rdp_per_group(
    poisson: List[Tuple[float, float, float]], wor: List[Tuple[float, float, float]], orders: List[float]
) -> npt.NDArray[np.float64]:
    """One row per group (Poisson groups first, then without-replacement ones), flattened:
    RDP of a single step of each group at each order. Counts are ignored."""
def epsilon_composition(
    poisson: List[Tuple[float, float, float]],
    wor: List[Tuple[float, float, float]],
    non_private: bool,
    orders: List[float],
    delta: float,
    rdp: Optional[List[float]] = None,
) -> Tuple[float, float, bool]:
    """(ε, best order, best order at the grid's edge) for a composition. `rdp`: the composition's
    values on `orders` if already known (else computed)."""
def delta_composition(
    poisson: List[Tuple[float, float, float]],
    wor: List[Tuple[float, float, float]],
    non_private: bool,
    orders: List[float],
    epsilon: float,
    rdp: Optional[List[float]] = None,
) -> Tuple[float, float, bool]:
    """(δ, best order, at edge) for a composition at `epsilon`."""
def epsilon_from_rdp(orders: List[float], rdp: List[float], delta: float) -> Tuple[float, float]:
    """(ε, best order) from RDP values on a grid alone: no continuous search (nothing is known
    between the orders)."""
def calibrate_noise_multiplier(
    target_epsilon: float, target_delta: float, q: float, steps: float, orders: List[float]
) -> float:
    """Smallest noise multiplier z with ε ≤ target_epsilon at target_delta after `steps` Poisson-subsampled Gaussian steps at rate q, under RDP over `orders` (Mironov, Talwar, Zhang 2019 §3; Canonne, Kamath, Steinke 2020 Prop. 12). ValueError on out-of-range parameters."""
def calibrate_sampling_probability(
    target_epsilon: float, target_delta: float, z: float, steps: float, orders: List[float]
) -> float:
    """Largest sampling probability q with ε ≤ target_epsilon at target_delta after `steps` steps with noise multiplier z, under RDP over `orders` (0.0 if none fits)."""
def calibrate_steps(target_epsilon: float, target_delta: float, q: float, z: float, orders: List[float]) -> int:
    """Largest number of steps with ε ≤ target_epsilon at target_delta for rate q and noise multiplier z, under RDP over `orders` (0 if none fits)."""
def _log_a_quadrature(q: float, z: float, alpha: float) -> float:
    """log A_α by quadrature at any real α > 1 (tests compare it with the exact integer sums)."""
def default_rdp_orders() -> List[float]:
    """The default grid of Rényi orders of the RDP accountant."""
def pld_epsilon_bounds(
    groups: List[Tuple[float, float, float]],
    delta: float,
    interval: Optional[float] = ...,
    lower: bool = ...,
    truncated: List[Tuple[float, float, int, int, float]] = ...,
) -> Tuple[float, float, float]:
    """(lower, upper, grid interval) of ε at δ for Poisson-subsampled Gaussian groups (q, z, count)
    and truncated-Poisson ones (q, z, max_sample_size, population_size, count) under
    add-or-remove, by privacy loss distributions. `lower = false` skips the lower bound."""
def pld_compose(
    parts: List[Tuple[int, npt.NDArray[np.float64], float, float, float]],
    interval: float,
    tail: float,
    max_bins: int,
    pessimistic: bool,
    target: Optional[Tuple[str, float]] = ...,
    halve: bool = ...,
) -> Tuple[int, npt.NDArray[np.float64], float, float]:
    """The certified composition of discrete PLDs (tilted towards `target`, ("delta", δ) or
    ("epsilon", ε), the transform's rounding bounded): (offset, atoms, mass at +∞, mass to
    subtract from δ for a lower bound)."""
def pld_delta_bounds(
    groups: List[Tuple[float, float, float]],
    epsilon: float,
    interval: Optional[float] = ...,
    lower: bool = ...,
    truncated: List[Tuple[float, float, int, int, float]] = ...,
) -> Tuple[float, float, float]:
    """(lower, upper, grid interval) of δ at ε, as [`pld_epsilon_bounds`]."""
def truncated_poisson_mixture(q: float, max_sample_size: int, population_size: int) -> Tuple[float, float, float, float, float]:
    """The dominating mixture of one truncated-Poisson-sampled Gaussian step (rust/accounting/pld/
    truncated.rs): (a, b, x, q_b, q_eff): weights of the pairs (q, z) and (q_b, z/2) and of the
    upper envelope of their curves, and the Poisson rate the step dominates."""
