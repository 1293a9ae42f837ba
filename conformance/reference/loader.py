"""Model lookup for the reference engine: "toy" is the kit's own unit-test model, every
other name is a tiny twin from ``conformance.reference.model`` (imported lazily)."""

from __future__ import annotations

from conformance.errors import KitError
from conformance.reference.toy_model import TOY_NAME, load_toy
from conformance.reference.model import load_twin


def known_models() -> list[str]:
    """Every model name ``--model`` accepts."""
    names = [TOY_NAME]
    try:
        from conformance.reference.model import known_twins  # deferred: the model imports torch, and its absence is reported here in one line
    except ImportError:
        return names
    return names + list(known_twins())


def load_model(name: str):
    """The model called ``name`` (the toy model or a tiny twin); KitError if unknown."""
    if name == TOY_NAME:
        return load_toy()
    known = known_models()
    if name not in known:
        raise KitError(f"unknown model {name!r}; known: {', '.join(known)}")
    return load_twin(name)
