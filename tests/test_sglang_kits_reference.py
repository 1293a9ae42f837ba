"""SGLang 0.5.23's own HTTP test kits against the reference target, imported from the
installed ``sglang`` package at test time (their code is not copied into the kit).

Run here (they need no hub data): the basic API contract kit (health, info, OpenAI
completions and chat), the prefix-cache branching kit ("hi" * 257 + three suffixes, on a
64-token and a 128-token chunk twin), the streaming-session kit's KV inheritance and its
three abort-recovery tests, ``AbortAllMixin`` (abort_all while decoding), and the KL kit's
prefill-hit and decode-hit helpers fed through their own on-disk prompt cache with the
kit's prompts instead of LongBench.  Not run in CI: the radix-cache server kit (400 requests
with up to 256 decode tokens each: about 25 minutes on this CPU engine, see
docs/reference-target.md) and the streaming-session stress and concurrent-logprob tests
(several minutes each); their HTTP surface is what the tests here already use.
"""

from __future__ import annotations

import json
import random
import tempfile
import unittest
from pathlib import Path

import requests
from sglang.srt.utils.hf_transformers_utils import get_tokenizer
from sglang.test import kl_test_utils
from sglang.test.kits.abort_timeout_kit import AbortAllMixin
from sglang.test.kits.basic_api_contract_kit import BasicAPIContractMixin
from sglang.test.kits.kl_divergence_kit import KLDivergenceMixin
from sglang.test.kits.prefix_cache_branching_kit import PrefixCacheBranchingMixin
from sglang.test.kits.streaming_session_kit import StreamingSessionKitMixin

from conformance.reference.twins import ensure_twin
from conformance.targets.reference_launch import start_reference


class _Polled:
    """``poll()`` over the kit's ServerProcess, as SGLang's kits expect of ``self.process``."""

    def __init__(self, sp) -> None:
        self.sp = sp

    def poll(self) -> int | None:
        return None if self.sp.exit_reason() is None else 1


class _ReferenceServer:
    """setUpClass/tearDownClass of SGLang's fixtures, serving a twin on the reference target."""

    twin = "tiny-qwen3-next"
    strategy = "extra_buffer"
    server_args: tuple[str, ...] = ()

    @classmethod
    def setUpClass(cls):
        cls.model = str(ensure_twin(cls.twin))  # SGLang's kits load the tokenizer from the model path
        cls._logs = tempfile.TemporaryDirectory()
        cls._server, cls.base_url = start_reference(Path(cls._logs.name), "--model", cls.twin, "--strategy", cls.strategy,
                                                    *cls.server_args)
        cls.process = _Polled(cls._server)
        cls.tokenizer = get_tokenizer(cls.model)

    @classmethod
    def tearDownClass(cls):
        cls._server.stop()
        cls._logs.cleanup()

    @classmethod
    def flush_cache(cls):
        requests.post(cls.base_url + "/flush_cache", timeout=30).raise_for_status()


class TestBasicAPIContract(_ReferenceServer, BasicAPIContractMixin, unittest.TestCase):
    pass


class TestPrefixCacheBranchingChunk64(_ReferenceServer, PrefixCacheBranchingMixin, unittest.TestCase):
    cache_chunk_size = 64  # Qwen3-Next's FLA chunk


class TestPrefixCacheBranchingChunk128(_ReferenceServer, PrefixCacheBranchingMixin, unittest.TestCase):
    twin, strategy, cache_chunk_size = "tiny-nemotron-h", "extra_buffer_lazy", 128


class TestStreamingSessionAbortRecovery(_ReferenceServer, StreamingSessionKitMixin, unittest.TestCase):
    test_leak_logprob_concurrent = None  # minutes of CPU decode each; see the module docstring
    test_stress_concurrent_sessions = None


class TestAbortAll(_ReferenceServer, AbortAllMixin, unittest.TestCase):
    abort_all_num_requests = 8  # the kit's 32 x 16000-token decodes, scaled to two CPU cores


class TestKLDivergence(_ReferenceServer, KLDivergenceMixin, unittest.TestCase):
    """SGLang's KL helpers read their prompts from an on-disk cache before they would download
    LongBench; the cache is filled with the kit's own prompts (random ids, 300-700 tokens)."""

    server_args = ("--track-interval", "64")  # decode-hit: 80 new tokens cross a decode track boundary
    kl_div_thres = 1e-4
    kl_div_max_samples = 4
    kl_div_prefill_max_new_tokens = 8
    kl_div_decode_max_new_tokens = 80

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._kl_cache = tempfile.TemporaryDirectory()
        cls._old_cache_dir, kl_test_utils.CACHE_DIR = kl_test_utils.CACHE_DIR, cls._kl_cache.name
        rng = random.Random(7)
        prompts = [[rng.randrange(4, 32000) for _ in range(300 + 100 * i)] for i in range(cls.kl_div_max_samples)]
        name = cls.model.replace("/", "_").replace("\\", "_")
        path = Path(cls._kl_cache.name) / f"input_ids_{name}_{kl_test_utils.DEFAULT_PROMPT_TOKENS}_{kl_test_utils.DEFAULT_NUM_SAMPLES}.json"
        path.write_text(json.dumps(prompts))

    @classmethod
    def tearDownClass(cls):
        kl_test_utils.CACHE_DIR = cls._old_cache_dir
        cls._kl_cache.cleanup()
        super().tearDownClass()
