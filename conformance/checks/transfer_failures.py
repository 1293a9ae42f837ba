"""PD transfer-failure check: with SGLang's own failure injection on the decode server's
transfer polls (``SGLANG_TEST_DISAGG_FAILURE_PROB``), every request must end either served
(all its tokens) or with SGLang's transfer-failure error; some must fail (else the switch
never bit and the check would pass on nothing); a follow-up request must still be served.
The slots of the failed requests are judged by the idle invariant on both servers
(``checks.leaks.leak_verdict``, folded in by the suite), not here.

Pure: judges a :class:`~conformance.recordings.TransferFailureRecording`.
"""

from __future__ import annotations

import re

from conformance.recordings import TransferFailureRecording, TransferOutcome
from conformance.records import Verdict

CHECK = "transfer_failures"
#: SGLang 0.5.23's own lines for a failed PD transfer (``disaggregation/decode.py``): the
#: transfer queue's and the handshake's (both polls carry the failure injection); and the
#: prefill side's (``disaggregation/prefill.py``) for a request whose decode side failed its
#: handshake before telling the prefill server (it ends at SGLang's bootstrap timeout).
SGLANG_FAILURE = re.compile(r"Decode (?:transfer|handshake) failed for request|Prefill bootstrap failed for request")


def is_served(o: TransferOutcome, new_tokens: int) -> bool:
    return o.status == 200 and o.finish not in ("abort", "error", "http") and o.tokens == new_tokens


def is_transfer_failure(o: TransferOutcome) -> bool:
    """Ended by SGLang's transfer-failure error (an abort or an error status carrying its line)."""
    return o.finish in ("abort", "http") and bool(SGLANG_FAILURE.search(o.message))


def transfer_failure_verdict(rec: TransferFailureRecording) -> Verdict:
    served = [o for o in rec.outcomes if is_served(o, rec.new_tokens)]
    failed = [o for o in rec.outcomes if is_transfer_failure(o)]
    other = [o for o in rec.outcomes if o not in served and o not in failed]
    follow_ok = bool(rec.follow_up) and is_served(rec.follow_up[-1], 1)
    metrics = {
        "requests": len(rec.outcomes), "served": len(served), "transfer_failed": len(failed), "unexpected": len(other),
        "failure_prob": rec.failure_prob, "follow_up_tries": len(rec.follow_up),
    }
    details = {
        "failure_messages": sorted({SGLANG_FAILURE.search(o.message).group(0) for o in failed}),
        "first_failure": failed[0].message if failed else "",
        "unexpected": [o.__dict__ for o in other[:5]],
        "follow_up": [o.__dict__ for o in rec.follow_up[-3:]],
    }
    fails = []
    if not rec.outcomes:
        return Verdict(CHECK, "skip", metrics, "vacuous: no request was sent", details)
    if other:
        o = other[0]
        fails.append(f"{len(other)}/{len(rec.outcomes)} request(s) ended neither served nor with SGLang's transfer-failure error, "
                     f"first: status {o.status}, finish {o.finish!r}, {o.tokens}/{rec.new_tokens} tokens{': ' + o.message[:160] if o.message else ''}")
    if not failed:
        fails.append(f"no request failed its transfer at SGLANG_TEST_DISAGG_FAILURE_PROB={rec.failure_prob:g} "
                     f"({len(rec.outcomes)} requests): the failure path was never exercised")
    if not follow_ok:
        last = rec.follow_up[-1] if rec.follow_up else None
        fails.append(f"no follow-up request was served in {len(rec.follow_up)} tries after the failures"
                     + (f" (last: status {last.status}, finish {last.finish!r}{': ' + last.message[:120] if last.message else ''})" if last else ""))
    if fails:
        return Verdict(CHECK, "fail", metrics, "; ".join(fails), details)
    return Verdict(CHECK, "pass", metrics, "", details)
