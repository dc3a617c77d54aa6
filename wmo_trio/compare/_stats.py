"""The statistics of a comparison, over per-task mean rewards.

Every function takes a leading batch axis where it helps (`values[..., tasks]`), so the
simulations in the tests run the very code a comparison runs, on a thousand data sets at
once. numpy is imported here, and this module only by `wmo_trio.compare`: the agent and
`import wmo_trio` never pay for it. scipy (about a second of CPU to import) is imported by
the functions that use it, so a comparison refused for bad input never pays for it.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]

DEFAULT_RESAMPLES = 10_000
CONFIDENCE = 0.95
# Beyond this many non-zero paired differences the exact sign-flip enumeration (2^n sums)
# costs more than a comparison should; the Wilcoxon signed-rank test takes over.
EXACT_SIGN_FLIP_LIMIT = 22
_CHUNK = 1 << 22  # sums held at once by the enumeration, so memory stays bounded


def bootstrap_interval(values: npt.ArrayLike, *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                       confidence: float = CONFIDENCE) -> tuple[Floats, Floats]:
    """The bootstrap confidence interval of the mean over the last axis (tasks): BCa, by
    `scipy.stats.bootstrap` (numpy resampling, vectorised, `seed` makes it reproducible).

    A paired comparison passes the per-task differences, so the tasks are resampled as
    pairs. Fewer than two tasks give NaN (no interval can be had from one task); a row
    whose values are all equal gives that value at both ends (the resampling cannot vary
    it, and BCa is undefined there).
    """
    data = np.asarray(values, dtype=np.float64)
    batch = data.shape[:-1]
    low, high = np.full(batch, np.nan), np.full(batch, np.nan)
    if data.shape[-1] < 2:
        return low, high
    flat = data.reshape(-1, data.shape[-1])
    constant = np.ptp(flat, axis=-1) == 0
    low.reshape(-1)[constant] = high.reshape(-1)[constant] = flat[constant, 0]
    varying = flat[~constant]
    if len(varying):
        lo, hi = _bca_or_percentile(varying, resamples, seed, confidence)
        low.reshape(-1)[~constant], high.reshape(-1)[~constant] = lo, hi
    return low, high


def _bca_or_percentile(data: Floats, resamples: int, seed: int,
                       confidence: float) -> tuple[Floats, Floats]:
    import scipy.stats

    def interval(method: str) -> tuple[Floats, Floats]:
        with warnings.catch_warnings():
            # A degenerate row in BCa's jackknife warns and gives NaN; handled below.
            warnings.simplefilter("ignore", scipy.stats.DegenerateDataWarning)
            result = scipy.stats.bootstrap(
                (data,), np.mean, n_resamples=resamples, batch=max(1, 4_000_000 // data.size),
                vectorized=True, axis=-1, confidence_level=confidence, method=method,
                rng=np.random.default_rng(seed))
        ci: Any = result.confidence_interval
        return np.atleast_1d(ci.low).astype(np.float64), np.atleast_1d(ci.high).astype(np.float64)

    low, high = interval("BCa")
    undefined = np.isnan(low) | np.isnan(high)
    if undefined.any():  # discrete data with a lopsided jackknife: the percentile interval
        plow, phigh = interval("percentile")
        low[undefined], high[undefined] = plow[undefined], phigh[undefined]
    return low, high


def sign_flip_p_value(differences: npt.ArrayLike) -> tuple[float, str]:
    """Two-sided p-value of "no difference" for paired per-task differences, and its method.

    Under the null each difference is as likely negated, so the exact test enumerates every
    sign pattern of the non-zero differences (a zero flips to itself and changes nothing)
    and counts the sums at least as far from zero as the observed one. Past
    `EXACT_SIGN_FLIP_LIMIT` non-zero differences: `scipy.stats.wilcoxon`. No non-zero
    difference ("all tied"): p = 1.

    scipy's own exact `permutation_test` gives the same value (a test checks it) but builds
    every resample's full data, which at these sizes costs seconds and gigabytes; the sums
    alone are what the test needs.
    """
    data = np.asarray(differences, dtype=np.float64).ravel()
    nonzero = data[~np.isclose(data, 0.0, rtol=0.0, atol=1e-12)]
    if len(nonzero) == 0:
        return 1.0, "all tied"
    if len(nonzero) > EXACT_SIGN_FLIP_LIMIT:
        import scipy.stats

        return float(scipy.stats.wilcoxon(nonzero).pvalue), "wilcoxon"
    return float(exact_sign_flip(nonzero[np.newaxis, :])[0]), "exact sign-flip"


def exact_sign_flip(differences: npt.ArrayLike) -> Floats:
    """Exact two-sided sign-flip p-values for each row of `differences` (rows of equal
    length, at most `EXACT_SIGN_FLIP_LIMIT` columns)."""
    data = np.asarray(differences, dtype=np.float64)
    rows, n = data.shape
    if n > EXACT_SIGN_FLIP_LIMIT:
        raise ValueError(f"{n} differences: too many to enumerate; use sign_flip_p_value")
    magnitudes = np.abs(data)
    observed = np.abs(data.sum(axis=1))
    # Sums equal to the observed one up to rounding count as "as extreme".
    threshold = observed - 1e-9 * np.maximum(1.0, magnitudes.sum(axis=1))
    p_values = np.empty(rows)
    per_block = max(1, _CHUNK >> n)
    for start in range(0, rows, per_block):
        block = magnitudes[start:start + per_block]
        # Every sign pattern's sum, one difference at a time: 2^n sums per row.
        sums = np.zeros((len(block), 1))
        for column in block.T:
            sums = np.concatenate([sums + column[:, np.newaxis], sums - column[:, np.newaxis]],
                                  axis=1)
        p_values[start:start + per_block] = np.mean(
            np.abs(sums) >= threshold[start:start + per_block, np.newaxis], axis=1)
    return p_values


def pass_at_k(successes: list[list[bool]]) -> dict[int, float]:
    """pass@k over tasks, each task's list of attempt outcomes, the unbiased estimator
    1 - C(n - c, k) / C(n, k) per task, averaged. k as harbor reports it: 2, 4, 8, ... and
    5, 10, 15, ... up to the fewest attempts of any task."""
    if not successes:
        return {}
    from scipy.special import comb

    fewest = min(len(task) for task in successes)
    ks = sorted({2 ** p for p in range(1, 32) if 2 ** p <= fewest} | set(range(5, fewest + 1, 5)))
    result: dict[int, float] = {}
    for k in ks:
        n = np.array([len(task) for task in successes])
        c = np.array([sum(task) for task in successes])
        failing_all = comb(n - c, k, exact=False) / comb(n, k, exact=False)
        result[k] = float(np.mean(1.0 - failing_all))
    return result
