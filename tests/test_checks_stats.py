"""Statistics helpers against known values."""

from __future__ import annotations

import pytest

from conformance.checks.stats import mcnemar_exact, required_n, required_n_paired, standard_error, wilson_interval
from conformance.errors import KitError


def test_wilson_interval_known_value_and_edges():
    low, high = wilson_interval(186, 200)
    assert low == pytest.approx(0.8859, abs=1e-3) and high == pytest.approx(0.9578, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0)
    with pytest.raises(KitError):
        wilson_interval(5, 3)


def test_standard_error_at_sglang_sample_size_is_two_points():
    assert 0.017 < standard_error(0.93, 200) < 0.019
    assert 0.023 < standard_error(0.87, 200) < 0.025


def test_mcnemar_exact_one_sided_and_no_discordance():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(6, 0, alternative="greater") == pytest.approx(1 / 64)
    assert mcnemar_exact(0, 6, alternative="greater") == pytest.approx(1.0)
    assert mcnemar_exact(3, 3) == pytest.approx(1.0)


def test_required_n_for_a_two_point_margin_is_far_above_200():
    assert required_n(0.93, 0.02) > 600
    assert required_n(0.93, 0.05) < 200
    assert required_n_paired(0.1, 0.03) > 200
    with pytest.raises(KitError):
        required_n(0.9, 0.0)
