"""GSM8K check: lm-eval's per-item results judged with the kit's statistics, a Wilson
interval on accuracy and an exact paired McNemar test against the model's baseline
(``no_buffer``) cell on the same questions.

The answers come from lm-eval's own gsm8k task (``workloads.gsm8k_lm_eval``): its prompt,
its ``strict-match`` / ``flexible-extract`` filters and its ``exact_match`` metric decide
whether an item is correct; this module only counts.  Two modes:

* ``accuracy`` (real models): fail when the whole Wilson interval lies below the model's
  minimum accuracy, or when the strategy is significantly worse than the baseline on the
  paired questions (one-sided exact McNemar, ``p < alpha``). The rule text and the n the
  rule needs to resolve a 2-point margin are in the verdict's details.
* ``agreement`` (CPU twins, where accuracy means nothing): every completion must equal
  the baseline cell's completion for the same question.

The paired baseline is named (``baseline_id``, ``matrix.baseline_id``): when its answers are
missing from the run, the verdict says so and which cell it was, never a silent
``paired_n=0``.

Every verdict's metrics name the ``engine`` (``lm-eval <version>``) that produced the answers.
"""

from __future__ import annotations

from typing import Literal

from conformance.checks.stats import mcnemar_exact, required_n, standard_error, wilson_interval
from conformance.errors import KitError
from conformance.recordings import GSM8KAnswer, GSM8KRecording
from conformance.checks.findings import Finding, failing
from conformance.records import Verdict

CHECK = "gsm8k"
Mode = Literal["accuracy", "agreement"]
Filter = Literal["strict", "flexible"]


def is_correct(a: GSM8KAnswer, filt: Filter) -> bool:
    return a.strict if filt == "strict" else a.flexible


def gsm8k_verdict(
    rec: GSM8KRecording,
    *,
    mode: Mode,
    baseline: GSM8KRecording | None = None,
    min_accuracy: float = 0.0,
    alpha: float = 0.05,
    primary: Filter = "flexible",
    margin: float = 0.02,
    baseline_id: str | None = None,
) -> Verdict:
    """Judge one cell's answers (and, given, the baseline cell's answers to the same items).
    ``baseline_id`` names the paired baseline cell; without its answers the verdict says
    the paired test did not run and why."""
    n = len(rec.answers)
    if mode not in ("accuracy", "agreement"):
        raise KitError(f"gsm8k: unknown mode {mode!r} (accuracy or agreement)")
    if not rec.engine:
        raise KitError("gsm8k: the recording does not name the engine that scored it (lm-eval and its version)")
    if n == 0:
        return Verdict(CHECK, "skip", {"n": 0, "accuracy": None, "wilson_low": None, "agreement": None, "engine": rec.engine, "mode": mode},
                       "no question was answered")
    missing = ""
    if baseline is None and baseline_id:
        missing = f"paired test not run: baseline cell {baseline_id} has no GSM8K answers in this run (select it too)"
    elif baseline is not None and not _pairs(rec, baseline):
        missing = f"paired test not run: baseline {baseline.label or baseline_id} answered none of these {n} questions"
    correct = sum(is_correct(a, primary) for a in rec.answers)
    acc = correct / n
    low, high = wilson_interval(correct, n)
    strict_acc = sum(is_correct(a, "strict") for a in rec.answers) / n
    flex_acc = sum(is_correct(a, "flexible") for a in rec.answers) / n
    pairs = _pairs(rec, baseline)
    agreement = sum(a.completion == b.completion for a, b in pairs) / len(pairs) if pairs else None
    need = required_n(max(min_accuracy, acc), margin)
    metrics = {
        "n": n,
        "accuracy": acc,
        "wilson_low": low,
        "agreement": agreement,
        "strict_accuracy": strict_acc,
        "flexible_accuracy": flex_acc,
        "standard_error": standard_error(acc, n),
        "paired_n": len(pairs),
        "paired_baseline": baseline_id or (baseline.label if baseline is not None else None),
        "mode": mode,
        "engine": rec.engine,
    }
    details: dict = {"wilson_high": high, "primary_filter": primary, "required_n_for_margin": need, "margin": margin}

    if mode == "agreement":
        details["rule"] = "agreement mode (CPU twin, accuracy not meaningful): every completion equals the baseline cell's"
        if not pairs:
            return Verdict(CHECK, "skip", metrics, missing or "agreement mode needs the baseline cell's answers to the same questions", details)
        differing = [a.index for a, b in pairs if a.completion != b.completion]
        if differing:
            return failing(CHECK, [Finding("answers_differ", f"{len(differing)}/{len(pairs)} completions differ from the baseline (items {differing[:8]})",
                                           {"differing": len(differing), "items": differing[:8]})], metrics, details)
        return Verdict(CHECK, "pass", metrics, "", details)

    only_base = sum(1 for a, b in pairs if is_correct(b, primary) and not is_correct(a, primary))
    only_this = sum(1 for a, b in pairs if is_correct(a, primary) and not is_correct(b, primary))
    p_worse = mcnemar_exact(only_base, only_this, alternative="greater") if pairs else None
    metrics["mcnemar_p"] = p_worse
    details.update({"baseline_only_correct": only_base, "this_only_correct": only_this})
    details["rule"] = (
        f"fail if the Wilson {0.95:.0%} upper bound {high:.3f} < min accuracy {min_accuracy:.3f}, or if the "
        f"baseline is significantly better on the paired questions (one-sided exact McNemar p < {alpha}); "
        f"at n={n} the standard error is {standard_error(acc, n) * 100:.1f} points, a +-{margin * 100:.0f}-point "
        f"interval needs n={need}"
    )
    fails = []
    if high < min_accuracy:
        fails.append(f"accuracy {acc:.3f} (Wilson {low:.3f}-{high:.3f}) is significantly below {min_accuracy:.3f}")
    if p_worse is not None and p_worse < alpha:
        fails.append(f"significantly worse than the baseline: {only_base} vs {only_this} discordant, McNemar p={p_worse:.3g}")
    if fails:
        return failing(CHECK, [Finding("accuracy_below", f) for f in fails], metrics, details, reason="; ".join(fails + ([missing] if missing else [])))
    return Verdict(CHECK, "pass", metrics, missing, details)


def _pairs(rec: GSM8KRecording, baseline: GSM8KRecording | None) -> list[tuple[GSM8KAnswer, GSM8KAnswer]]:
    if baseline is None:
        return []
    base = {a.index: a for a in baseline.answers}
    return [(a, base[a.index]) for a in rec.answers if a.index in base]
