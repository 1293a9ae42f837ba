"""SGLang's own HTTP test kits (``sglang/test/kits/``), as the running release ships them,
played against a server the kit started: the peer baseline of ``history --peer-kits``.

One :class:`PeerKit` record per kit mixin, in :data:`PEER_KITS`: the SGLang module and
mixin it imports by name (never a copy of its code), the test methods played, the ones not
played here and why, and the class attributes SGLang's own test classes set, scaled to two
CPU cores (fewer samples, shorter decodes).  The thresholds are the ones SGLang's own CI
classes use for the model family (``kl_div_thres``, ``cache_chunk_size``), named per family
in :data:`FAMILY_SETTINGS`.

:func:`play_kits` composes each mixin with a fixture that points at the running server
(``base_url``, ``process``, ``model``, ``tokenizer``, ``flush_cache``: what SGLang's fixtures
give the kits) and runs the selected tests with :mod:`unittest`; each test ends as one
:class:`KitOutcome` (``pass``, ``fail`` with its first line, ``n/a`` when the release does
not ship the kit or the test).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import random
import tempfile
import unittest
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import requests

#: Per model family: SGLang's own CI settings for its hybrid models' kit classes
#: (Qwen3-Next: ``kl_div_thres = 0.0025``, ``cache_chunk_size = 64``; Nemotron-H:
#: ``kl_div_thres = 0.008``, ``cache_chunk_size = 256``).  Granite-H and FalconH1 have no
#: kit class in SGLang's CI; they take the other Mamba2 family's settings.
FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    "qwen3-next": {"kl_div_thres": 0.0025, "cache_chunk_size": 64},
    "nemotron-h": {"kl_div_thres": 0.008, "cache_chunk_size": 256},
    "granite-h": {"kl_div_thres": 0.008, "cache_chunk_size": 256},
    "falcon-h1": {"kl_div_thres": 0.008, "cache_chunk_size": 256},
}

#: How many prompts the KL kit plays (SGLang's default is 32 LongBench prompts of up to
#: 3000 tokens; four random prompts of 300-600 tokens here).
KL_SAMPLES = 4
#: Seconds one HTTP question of the fixture may take.
TIMEOUT_S = 60


@dataclass(frozen=True)
class PeerServer:
    """The running server SGLang's kits are pointed at."""

    base_url: str
    model_path: str  # what SGLang's fixtures call ``model``: the tokenizer is loaded from it
    family: str
    track_interval: int
    alive: Callable[[], str | None]  # why the process is gone, None while it runs
    pool_tokens: int = 0  # SGLang's max_total_num_tokens (0: not known)
    strategy: str = ""  # SGLang's --mamba-scheduler-strategy
    overlap: bool = True  # the overlap scheduler runs (SGLang's disable_overlap_schedule is off)


@dataclass(frozen=True)
class KitOutcome:
    """One kit test on one server: ``pass``, ``fail`` (its first line) or ``n/a`` (why)."""

    kit: str
    test: str
    status: str
    line: str = ""

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> KitOutcome:
        return cls(str(d["kit"]), str(d["test"]), str(d["status"]), str(d.get("line", "")))


def _no_setup(server: PeerServer, tmp: Path) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@contextlib.contextmanager
def _kl_prompt_cache(server: PeerServer, tmp: Path) -> Iterator[None]:
    """SGLang's KL helpers read LongBench prompts from an on-disk cache before they would
    download them: the cache is filled with random token ids (300-600 tokens)."""
    utils = importlib.import_module("sglang.test.kl_test_utils")
    vocab = len(_tokenizer(server.model_path))
    rng = random.Random(7)
    prompts = [[rng.randrange(4, vocab - 1) for _ in range(300 + 100 * i)] for i in range(KL_SAMPLES)]
    name = server.model_path.replace("/", "_").replace("\\", "_")
    old, utils.CACHE_DIR = utils.CACHE_DIR, str(tmp)
    (tmp / f"input_ids_{name}_{utils.DEFAULT_PROMPT_TOKENS}_{utils.DEFAULT_NUM_SAMPLES}.json").write_text(json.dumps(prompts))
    try:
        yield
    finally:
        utils.CACHE_DIR = old


@dataclass(frozen=True)
class PeerKit:
    """One SGLang kit mixin as the peer baseline plays it."""

    name: str
    module: str  # imported by name from the running release
    mixin: str
    tests: tuple[str, ...]
    not_played: Mapping[str, str] = field(default_factory=dict)  # test -> why it is not played here
    settings: Callable[[PeerServer], dict[str, Any]] = lambda server: {}
    setup: Callable[[PeerServer, Path], contextlib.AbstractContextManager] = _no_setup
    strategies: tuple[str, ...] = ()  # the strategies SGLang's own CI plays the kit on (empty: all)

    def load(self) -> type | str:
        """The mixin class of the running release, or why it is not there."""
        try:
            module = importlib.import_module(self.module)
        except ImportError as e:
            return f"this release ships no {self.module} ({e})"
        mixin = getattr(module, self.mixin, None)
        return mixin if isinstance(mixin, type) else f"this release's {self.module} has no {self.mixin}"

    def refusal(self, server: PeerServer) -> str | None:
        """Why the kit is not played on this server (SGLang's own CI would not play it), or None."""
        if self.strategies and server.strategy and server.strategy not in self.strategies:
            return (f"SGLang's own CI plays this kit on {'/'.join(self.strategies)} servers only; "
                    f"this one runs {server.strategy}")
        return None

    def play(self, server: PeerServer, tmp: Path) -> list[KitOutcome]:
        mixin = self.load()
        why = mixin if isinstance(mixin, str) else self.refusal(server)
        if why:
            return [KitOutcome(self.name, t, "n/a", why) for t in self.tests]
        out = []
        case = type(f"Peer{self.mixin}", (mixin, unittest.TestCase), _fixture(server) | self.settings(server))
        with self.setup(server, tmp):
            for test in self.tests:
                if not callable(getattr(case, test, None)):
                    out.append(KitOutcome(self.name, test, "n/a", f"this release's {self.mixin} has no {test}"))
                    continue
                out.append(_run_one(self.name, case, test, server))
        return out


def _kl_settings(server: PeerServer) -> dict[str, Any]:
    return {"kl_div_thres": FAMILY_SETTINGS[server.family]["kl_div_thres"], "kl_div_max_samples": KL_SAMPLES,
            "kl_div_prefill_max_new_tokens": 8,
            # a decode hit needs the decode to cross a track boundary
            "kl_div_decode_max_new_tokens": server.track_interval + 16}


def _abort_all_settings(server: PeerServer) -> dict[str, Any]:
    """The kit's 32 x 16000-token decodes, scaled to two CPU cores and to decodes the
    server's KV pool holds at once (a request still queued when the abort comes is answered
    without ``meta_info``, which the kit reads)."""
    n = 8
    out: dict[str, Any] = {"abort_all_num_requests": n}
    if server.pool_tokens:
        out["abort_all_max_new_tokens"] = min(16000, server.pool_tokens // (2 * n))
    return out


def _session_settings(server: PeerServer) -> dict[str, Any]:
    """As SGLang's own fixtures set it: kits before ``kv_inherit_offsets`` expect a server
    without the overlap scheduler to inherit one token less (its last sampled token is not
    committed when max_new stops: ``kv_inherit_offset = -1``); later kits name their own."""
    return {} if server.overlap else {"kv_inherit_offset": -1}


#: SGLang's own CI plays its KL and prefix-branching kits on these strategies only.
EXTRA_BUFFER = ("extra_buffer", "extra_buffer_lazy")

#: The kits played, in order (each leaves the server as a kit test would: flushed at its start).
PEER_KITS: tuple[PeerKit, ...] = (
    PeerKit("kl_divergence", "sglang.test.kits.kl_divergence_kit", "KLDivergenceMixin",
            ("test_input_output_logprobs_match_prefill_cache_hit", "test_input_output_logprobs_match_decode_cache_hit"),
            settings=_kl_settings, setup=_kl_prompt_cache, strategies=EXTRA_BUFFER),
    PeerKit("prefix_cache_branching", "sglang.test.kits.prefix_cache_branching_kit", "PrefixCacheBranchingMixin",
            ("test_prefix_cache_branching",),
            settings=lambda s: {"cache_chunk_size": FAMILY_SETTINGS[s.family]["cache_chunk_size"]}, strategies=EXTRA_BUFFER),
    PeerKit("streaming_session", "sglang.test.kits.streaming_session_kit", "StreamingSessionKitMixin",
            ("test_kv_cache_inheritance", "test_preabort_recovery"),
            not_played={"test_leak_logprob_concurrent": "minutes of CPU decode (6 sessions x 5 turns x 10 rounds)",
                        "test_stress_concurrent_sessions": "minutes of CPU decode (8 sessions x 6 turns)",
                        "test_nth_mid_abort_recovery": "asks for 100000 new tokens, more than the CPU server's KV pool: SGLang refuses it",
                        "test_first_mid_abort_recovery": "asks for 100000 new tokens, more than the CPU server's KV pool: SGLang refuses it"},
            settings=_session_settings),
    PeerKit("abort_leak_repro", "sglang.test.kits.streaming_session_kit", "AbortLeakReproKitMixin",
            ("test_abort_heavy_chunked_prefill_does_not_leak",)),
    PeerKit("abort_all", "sglang.test.kits.abort_timeout_kit", "AbortAllMixin", ("test_abort_all",),
            settings=_abort_all_settings),
)


@functools.lru_cache(maxsize=4)
def _tokenizer(model_path: str) -> Any:
    """The served model's tokenizer, loaded once per run (every kit's fixture and the KL prompts ask it)."""
    utils = importlib.import_module("sglang.srt.utils.hf_transformers_utils")
    return utils.get_tokenizer(model_path)


class _Polled:
    """``poll()`` over the server's liveness, as SGLang's kits ask ``self.process``."""

    def __init__(self, alive: Callable[[], str | None]) -> None:
        self.alive = alive

    def poll(self) -> int | None:
        return None if self.alive() is None else 1


def _fixture(server: PeerServer) -> dict[str, Any]:
    """What SGLang's server fixtures give the kits, as class attributes."""
    def flush_cache(cls) -> None:
        requests.post(cls.base_url + "/flush_cache", timeout=TIMEOUT_S)

    return {"base_url": server.base_url, "model": server.model_path, "process": _Polled(server.alive),
            "tokenizer": _tokenizer(server.model_path), "flush_cache": classmethod(flush_cache)}


def _run_one(kit: str, case: type, test: str, server: PeerServer) -> KitOutcome:
    result = unittest.TestResult()
    case(test).run(result)
    problems = result.failures + result.errors
    if problems:
        text = problems[0][1].strip().splitlines()
        line = next((ln for ln in reversed(text) if ln.strip()), "")
        gone = server.alive()
        return KitOutcome(kit, test, "fail", (line + (f" (server gone: {gone})" if gone else ""))[:400])
    if result.skipped:
        return KitOutcome(kit, test, "n/a", f"skipped by the kit: {result.skipped[0][1]}"[:400])
    return KitOutcome(kit, test, "pass")


def play_kits(server: PeerServer, kits: tuple[PeerKit, ...] = PEER_KITS) -> list[KitOutcome]:
    """Every kit's selected tests against ``server``, in order; a dead server makes the rest n/a."""
    out: list[KitOutcome] = []
    with tempfile.TemporaryDirectory(prefix="hc-peer-kits-") as tmp:
        for kit in kits:
            gone = server.alive()
            if gone:
                out += [KitOutcome(kit.name, t, "n/a", f"not played: the server is gone ({gone})") for t in kit.tests]
                continue
            out += kit.play(server, Path(tmp))
    return out
