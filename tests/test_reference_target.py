"""Which cells the reference engine serves, and the reason it gives for the others: the
agreement suite states it as its "not applicable" line on a real-SGLang-only cell (it used
to be an error saying "cache variant 'radix' is served by real SGLang only" on every
server-option and page-size cell of the standard tier)."""

from __future__ import annotations

from conformance.matrix.cells import load_matrix
from conformance.targets.reference import ReferenceTarget


def _cells():
    return load_matrix().select(target="sglang-cpu", tier="nightly")


def test_the_reference_engine_names_why_it_cannot_serve_a_cell():
    ref = ReferenceTarget()
    cells = _cells()
    optioned = next(c for c in cells if c.options and c.cache_variant.name == "radix" and "reference" not in c.targets)
    why = ref.supports(optioned)
    assert why and "server options" in why and f"{optioned.options[0][0]}={optioned.options[0][1]}" in why and "'radix'" not in why
    paged = next(c for c in cells if not c.options and c.page_size == 256 and "reference" not in c.targets)
    why = ref.supports(paged)
    assert why and "'radix'" not in why and "sglang-cpu" in why
    variant = next(c for c in cells if c.cache_variant.name != "radix" and "reference" not in c.targets)
    assert f"{variant.cache_variant.name!r} is served by real SGLang only" in ref.supports(variant)
    assert ref.supports(next(c for c in cells if "reference" in c.targets)) is None
