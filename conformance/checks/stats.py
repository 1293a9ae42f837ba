"""Statistics for accuracy checks, built on scipy.stats: Wilson interval, exact McNemar,
and the sample size a margin needs (why SGLang's fixed thresholds at n=200 sit in noise)."""

from __future__ import annotations

import math

from scipy import stats

from conformance.errors import KitError


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; (0, 1) when n == 0."""
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise KitError(f"wilson_interval: need 0 <= successes <= n, got {successes}/{n}")
    if n == 0:
        return 0.0, 1.0
    ci = stats.binomtest(successes, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def standard_error(p: float, n: int) -> float:
    """Binomial standard error of an accuracy ``p`` measured on ``n`` items."""
    if n <= 0:
        return float("inf")
    return math.sqrt(max(p * (1.0 - p), 0.0) / n)


def mcnemar_exact(only_a: int, only_b: int, alternative: str = "two-sided") -> float:
    """Exact McNemar p-value from the discordant pairs.

    ``only_a``: items right under A and wrong under B; ``only_b``: the reverse.
    ``alternative="greater"`` tests whether A is right more often than B (B is worse).
    With no discordant pair the p-value is 1.
    """
    if only_a < 0 or only_b < 0:
        raise KitError(f"mcnemar_exact: discordant counts must be >= 0, got {only_a}, {only_b}")
    total = only_a + only_b
    if total == 0:
        return 1.0
    return float(stats.binomtest(only_a, total, 0.5, alternative=alternative).pvalue)


def required_n(p: float, half_width: float, confidence: float = 0.95) -> int:
    """Items needed for a two-sided interval of +-``half_width`` around accuracy ``p``."""
    if not 0 < half_width < 1:
        raise KitError(f"required_n: half_width must be in (0, 1), got {half_width}")
    z = float(stats.norm.ppf(0.5 + confidence / 2.0))
    return max(1, math.ceil(z * z * max(p * (1.0 - p), 1e-12) / (half_width * half_width)))


def required_n_paired(discordance: float, drop: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Paired items a one-sided McNemar test needs to detect an accuracy ``drop``.

    ``discordance`` is the expected fraction of items whose correctness differs between
    the two runs (the normal approximation of Connor, 1987).
    """
    if not 0 < drop <= discordance <= 1:
        raise KitError(f"required_n_paired: need 0 < drop <= discordance <= 1, got {drop}, {discordance}")
    za = float(stats.norm.ppf(1 - alpha))
    zb = float(stats.norm.ppf(power))
    n = (za * math.sqrt(discordance) + zb * math.sqrt(discordance - drop * drop)) ** 2 / (drop * drop)
    return max(1, math.ceil(n))
