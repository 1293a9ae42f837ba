"""Suite: pool-leak invariants — idle gauges back to 0 after scenarios and sessions, server log
scan, occupancy timeline and the lazy resident-slot ratio (server targets), plus the pool tier's
state machine over SGLang's real memory classes (``test_pool_*``)."""
