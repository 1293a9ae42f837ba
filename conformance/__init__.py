"""hybrid-conformance: conformance and regression kit for Mamba state caching in SGLang hybrid models.

Four nouns: ``targets`` (who answers), ``workloads`` (what is sent), ``checks``
(pure functions from recorded responses to a verdict) and the suites under
``conformance/{leaks,kl,prefix_branching,gsm8k,disagg}`` that bind them per cell.
"""

__version__ = "0.1.0"
