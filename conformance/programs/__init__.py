"""Randomized request programs with a differential oracle (``pytest -m programs``).

* ``program``     -- the data: a prefix forest and a list of steps; JSON in, JSON out.
* ``strategies``  -- the hypothesis generator of programs for one matrix cell.
* ``runner``      -- plays a program over HTTP against a target (requests in flight,
                     streaming, aborts, sessions) and hands every finished request,
                     and every idle moment, to the oracle.
* ``oracle``      -- the checks run after every step (pure; see ``conformance/checks``
                     for the pieces it reuses): served == cold, ``cached_tokens`` within
                     what the prefix oracle allows and equal to the server's counters,
                     SGLang's idle invariant, refusals explained by the pool's numbers.
* ``explore``     -- budgets, seeds, the per-target hypothesis database, shrinking and
                     the failure file with its replay command.
* ``test_programs`` -- the suite (one server per cell, plus one cache-off twin per model).
"""
