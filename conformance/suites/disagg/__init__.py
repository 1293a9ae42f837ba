"""Suite: PD disaggregation — prefill server + decode server + router as one cell, compared with the non-PD cell."""
