# Type stubs for the Rust extension module dpcore._core (see rust/bindings/).
from typing import List, Optional, Tuple

import numpy as np
import numpy.typing as npt

__version__: str
NOISE_CHUNK: int

def gaussian_sum_flat(
    arrays: List[np.ndarray],
    l2_norm_clip: float,
    noise_multiplier: float,
    denominator: Optional[float] = None,
    seed: Optional[int] = None,
    scales: Optional[List[float]] = None,
    f64_out: bool = False,
) -> Tuple[List[np.ndarray], npt.NDArray[np.float64]]: ...
def record_norms(arrays: List[np.ndarray], scales: Optional[List[float]] = None) -> npt.NDArray[np.float64]: ...
def part_sumsq(arrays: List[np.ndarray], parallel: bool = True) -> List[npt.NDArray[np.float64]]: ...
def gaussian_flat(n: int, stddev: float, double: bool, seed: Optional[int] = None, parallel: bool = True) -> np.ndarray: ...
def poisson_sample(n: int, q: float, seed: Optional[int] = None) -> npt.NDArray[np.uint64]: ...
def ledger_scan(
    data: bytes,
) -> Tuple[
    Optional[
        Tuple[int, int, Optional[str], List[Tuple[int, int, int, float, int, Optional[int], bool, bool, List[Tuple[float, float]]]]]
    ],
    int,
]: ...
def fixed_size_sample(n: int, b: int, seed: Optional[int] = None) -> npt.NDArray[np.uint64]: ...

# Accounting (rust/bindings/accounting.rs). Groups are (q or m/n, noise_multiplier, count).
def rdp_poisson_subsampled_gaussian(q: float, z: float, orders: List[float]) -> npt.NDArray[np.float64]: ...
def rdp_composition(
    poisson: List[Tuple[float, float, float]],
    wor: List[Tuple[float, float, float]],
    non_private: bool,
    orders: List[float],
) -> npt.NDArray[np.float64]: ...
def rdp_per_group(
    poisson: List[Tuple[float, float, float]], wor: List[Tuple[float, float, float]], orders: List[float]
) -> npt.NDArray[np.float64]: ...
def epsilon_composition(
    poisson: List[Tuple[float, float, float]],
    wor: List[Tuple[float, float, float]],
    non_private: bool,
    orders: List[float],
    delta: float,
    rdp: Optional[List[float]] = None,
) -> Tuple[float, float, bool]: ...
def delta_composition(
    poisson: List[Tuple[float, float, float]],
    wor: List[Tuple[float, float, float]],
    non_private: bool,
    orders: List[float],
    epsilon: float,
    rdp: Optional[List[float]] = None,
) -> Tuple[float, float, bool]: ...
def epsilon_from_rdp(orders: List[float], rdp: List[float], delta: float) -> Tuple[float, float]: ...
def calibrate_noise_multiplier(
    target_epsilon: float, target_delta: float, q: float, steps: float, orders: List[float]
) -> float: ...
def calibrate_sampling_probability(
    target_epsilon: float, target_delta: float, z: float, steps: float, orders: List[float]
) -> float: ...
def calibrate_steps(target_epsilon: float, target_delta: float, q: float, z: float, orders: List[float]) -> int: ...
def _log_a_quadrature(q: float, z: float, alpha: float) -> float: ...
def default_rdp_orders() -> List[float]: ...
def pld_epsilon_bounds(
    groups: List[Tuple[float, float, float]], delta: float, interval: Optional[float] = ..., lower: bool = ...
) -> Tuple[float, float, float]: ...
def pld_delta_bounds(
    groups: List[Tuple[float, float, float]], epsilon: float, interval: Optional[float] = ..., lower: bool = ...
) -> Tuple[float, float, float]: ...
