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
def gaussian_flat(n: int, stddev: float, double: bool, seed: Optional[int] = None) -> np.ndarray: ...
def poisson_sample(n: int, q: float, seed: Optional[int] = None) -> npt.NDArray[np.uint64]: ...
def fixed_size_sample(n: int, b: int, seed: Optional[int] = None) -> npt.NDArray[np.uint64]: ...
def _stream_read(a: npt.NDArray[np.float32]) -> float: ...
