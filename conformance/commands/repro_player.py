"""Play a known SGLang bug's request sequence against a running server and print, for every
judged request, the expected and the observed numbers.

Standalone on purpose: the standard library and ``requests`` only, neither the kit nor
SGLang.  ``hybrid-conformance report-bug`` copies this module's code, below a ``PLAN`` it
resolved from the entry's program file, into the bug folder's ``repro.py`` and
``test_regression.py`` (``conformance/commands/report_bug.py``).  It judges what the kit
judges (``conformance/programs/``):

* every answer against the cache-off answer of the same input + output, computed by one
  teacher-forced prefill after ``/flush_cache`` (or on ``--cold-url``, a server with the radix
  cache disabled): the token the cold side holds at each output position, its argmax and
  its logprob;
* ``cached_tokens`` where the kit's prefix oracle predicted it (the plan's ``hit``: requests
  sent with nothing else in flight);
* the pools at idle (``/metrics``: what is used beyond what sessions hold), and that the
  server is still alive.
"""

import argparse
import json
import re
import threading
import time
import uuid

import requests

TIMEOUT_S = 300.0
METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


class Observation:
    """One judged number: what the kit expects, what the server answered."""

    def __init__(self, rid, what, expected, observed, ok):
        self.rid, self.what, self.expected, self.observed, self.ok = rid, what, expected, observed, ok

    def line(self):
        return f"{'ok' if self.ok else 'DIFFERS':8} {self.rid}: {self.what}: expected {self.expected}, got {self.observed}"


class InFlight:
    """One ``/generate`` call on its own thread (a burst is one call for several rids)."""

    def __init__(self, rids, payload, stream):
        self.rids, self.payload, self.stream = rids, payload, stream
        self.answers, self.error, self.tokens = [], "", 0
        self.done, self.progress = threading.Event(), threading.Condition()

    def wait_tokens(self, n):
        with self.progress:
            self.progress.wait_for(lambda: self.tokens >= n or self.done.is_set(), timeout=TIMEOUT_S)


class Player:
    """Plays ``plan["steps"]`` in order, then judges (``run``)."""

    def __init__(self, url, plan, cold_url=None, out=print):
        self.url, self.plan, self.cold_url, self.out = url.rstrip("/"), plan, (cold_url or "").rstrip("/"), out
        self.tag = uuid.uuid4().hex[:8]
        self.http = requests.Session()
        self.http.trust_env = False
        self.flights, self.sent, self.sessions, self.findings = {}, [], {}, []
        self.dead = ""

    # ------------------------------------------------------------ HTTP
    def post(self, path, body, url=None, timeout=60.0):
        return self.http.post((url or self.url) + path, json=body, timeout=timeout)

    def flush(self, url=None):
        for _ in range(40):  # SGLang refuses a flush while requests run
            if self.post("/flush_cache", {}, url).status_code == 200:
                return
            time.sleep(0.25)
        raise RuntimeError(f"{url or self.url}/flush_cache refused 40 times")

    def metrics(self):
        values = {}
        for line in self.http.get(self.url + "/metrics", timeout=30).text.splitlines():
            m = METRIC_LINE.match(line)
            if m and not line.startswith("#"):
                try:
                    values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
                except ValueError:
                    pass
        for name, standin in self.plan["idle"].get("standins", {}).items():
            if name not in values and standin in values:
                values[name] = values[standin]
        return values

    def alive(self):
        try:
            return self.http.get(self.url + "/health", timeout=30).status_code == 200
        except requests.RequestException:
            return False

    def subst(self, value):
        """The plan's placeholders: ``{tag}`` (this run's rid prefix), ``{session:ID}``."""
        if isinstance(value, dict):
            return {k: self.subst(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.subst(v) for v in value]
        if isinstance(value, str):
            value = value.replace("{tag}", self.tag)
            return re.sub(r"\{session:([^}]+)\}", lambda m: self.sessions.get(m.group(1), m.group(1)), value)
        return value

    def tokens(self, segments):
        """A plan input: literal token lists, and ``{"output_of": rid, "start", "end"}`` slices
        of an earlier answer's output (what a follow-up continues)."""
        out = []
        for seg in segments:
            if isinstance(seg, dict):
                out += self.output_of(seg["output_of"])[seg["start"] : seg["end"]]
            else:
                out += seg
        return out

    def answer(self, rid):
        flight = self.flights.get(rid)
        if flight is None or not flight.done.is_set() or flight.error:
            return None
        i = flight.rids.index(rid)
        return flight.answers[i] if i < len(flight.answers) else None

    def output_of(self, rid):
        self.wait(rid)
        return list((self.answer(rid) or {}).get("output_ids") or [])

    # ------------------------------------------------------------ flights
    def launch(self, step, rids, payload, stream):
        flight = InFlight(tuple(rids), payload, stream)
        for rid in rids:
            self.flights[rid] = flight
        threading.Thread(target=self._run_flight, args=(flight,), daemon=True).start()
        if step.get("abort_at") is not None:
            if step["abort_at"] > 0:
                flight.wait_tokens(step["abort_at"])
            if not flight.done.is_set():
                for rid in flight.rids:
                    self.post("/abort_request", {"rid": self.subst("{tag}-" + rid)})

    def _run_flight(self, flight):
        try:
            if flight.stream:
                with self.http.post(self.url + "/generate", json={**flight.payload, "stream": True}, stream=True, timeout=TIMEOUT_S) as resp:
                    if resp.status_code != 200:
                        flight.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                        return
                    for raw in resp.iter_lines(decode_unicode=True):
                        if not raw or not raw.startswith("data:") or raw[5:].strip() == "[DONE]":
                            continue
                        event = json.loads(raw[5:])
                        flight.answers = [event]
                        with flight.progress:
                            flight.tokens = len(event.get("output_ids") or [])
                            flight.progress.notify_all()
            else:
                resp = self.http.post(self.url + "/generate", json=flight.payload, timeout=TIMEOUT_S)
                if resp.status_code != 200:
                    flight.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                else:
                    body = resp.json()
                    flight.answers = body if isinstance(body, list) else [body]
        except (requests.RequestException, ValueError) as e:
            flight.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            with flight.progress:
                flight.done.set()
                flight.progress.notify_all()

    def wait(self, rid):
        flight = self.flights.get(rid)
        if flight is not None and not flight.done.wait(TIMEOUT_S + 30):
            raise RuntimeError(f"request {rid} did not answer within {TIMEOUT_S + 30:.0f} s")
        if flight is not None and flight.error and not self.dead and not self.alive():
            self.dead = f"{rid}: {flight.error}"

    def wait_all(self):
        for rid in list(self.flights):
            self.wait(rid)

    # ------------------------------------------------------------ steps
    def step_send(self, step):
        for rid in step.get("needs", []):
            self.wait(rid)
        if step.get("gate"):
            self.flights[step["gate"]["rid"]].wait_tokens(step["gate"]["tokens"])
        payload = {**self.subst(step["payload"]), "input_ids": self.tokens(step["input"])}
        self.sent.append(step)
        self.launch(step, [step["rid"]], payload, step.get("stream", False))

    def step_burst(self, step):
        self.sent.append(step)
        self.launch(step, step["rids"], self.subst(step["payload"]), False)

    def step_turn(self, step):
        for rid in step.get("needs", []):
            self.wait(rid)
        self.sent.append(step)
        self.launch(step, [step["rid"]], self.subst(step["payload"]), step.get("stream", False))

    def step_wait(self, step):
        self.wait(step["rid"])

    def step_idle(self, step):
        self.wait_all()
        self.judge_idle(f"idle after step {step['at']}")

    def step_open(self, step):
        resp = self.post("/open_session", {"capacity_of_str_len": 65536, "streaming": step["streaming"]})
        body = resp.json()
        self.sessions[step["sid"]] = body if isinstance(body, str) else body.get("session_id")

    def step_close(self, step):
        if step["sid"] in self.sessions:
            self.post("/close_session", {"session_id": self.sessions.pop(step["sid"])})

    def step_flush(self, step):
        self.wait_all()
        self.flush()

    # ------------------------------------------------------------ judging
    def note(self, rid, what, expected, observed, ok):
        finding = Observation(rid, what, expected, observed, ok)
        self.findings.append(finding)
        self.out(finding.line())

    def judge_idle(self, where):
        """The pools' idle numbers: nothing used beyond what sessions hold (polled: SGLang
        refreshes its idle gauges lazily), and the server alive."""
        idle = self.plan["idle"]
        deadline, values = time.monotonic() + idle["deadline_s"], {}
        while True:
            try:
                values = self.metrics()
            except requests.RequestException as e:
                self.dead = self.dead or f"{where}: GET /metrics: {type(e).__name__}"
                break
            leaks = {pool: values.get(t["used"], 0.0) - values.get(t["protected"], 0.0) - values.get(t["session_held"], 0.0)
                     for pool, t in idle["pools"].items() if t["used"] in values}
            if (leaks and not any(leaks.values())) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        last = " (the last sample before the server went away)" if self.dead else ""
        for pool, t in idle["pools"].items():
            if t["used"] not in values:
                continue
            used, held = values[t["used"]], values.get(t["session_held"], 0.0)
            shown = ", ".join(f"{k} {values[t[k]]:g}" for k in ("total", "available", "evictable", "protected", "session_held") if t[k] in values)
            self.note(where, f"{pool} pool at idle ({shown}){last}", f"used {held:g} (what sessions hold)", f"used {used:g}",
                      used - values.get(t["protected"], 0.0) - held == 0)
        if self.dead:
            self.note(where, "server", "alive and answering", f"gone ({self.dead})", False)

    def judge_answers(self):
        tol = self.plan["tolerance"]
        for step in self.sent:
            for i, rid in enumerate(step.get("rids") or [step["rid"]]):
                ans = self.answer(rid)
                if ans is None:
                    if step.get("abort_at") is None:
                        self.note(rid, "answer", "an answer", (self.flights[rid].error or "none")[:200], False)
                    continue
                meta = ans.get("meta_info") or {}
                if step.get("hit") is not None:
                    hits = step["hit"]
                    self.note(rid, "cached_tokens", hits[0] if len(hits) == 1 else f"one of {hits}", meta.get("cached_tokens"),
                              meta.get("cached_tokens") in hits)
                inputs = step["inputs"][i] if "inputs" in step else self.tokens(step["input"])
                if ans.get("output_ids") and not self.dead:
                    self.judge_cold(rid, inputs, ans, tol)

    def judge_cold(self, rid, inputs, ans, tol):
        """The served output against one teacher-forced cold prefill of input + output."""
        out, meta = list(ans["output_ids"]), ans.get("meta_info") or {}
        served = [e[0] for e in meta.get("output_token_logprobs") or []]
        start = max(0, len(inputs) - 1)
        url = self.cold_url or self.url
        self.flush(url)
        cold = self.post("/generate", {"input_ids": inputs + out, "sampling_params": {"temperature": 0.0, "max_new_tokens": 0},
                                       "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2,
                                       "return_text_in_logprobs": False}, url, timeout=TIMEOUT_S).json()
        cmeta = cold.get("meta_info") or {}
        entries, tops = cmeta.get("input_token_logprobs") or [], cmeta.get("input_top_logprobs") or []
        gap, first = 0.0, None
        for k, tok in enumerate(out):
            pos = len(inputs) + k
            i = pos - start
            if i >= len(entries):
                return self.note(rid, f"output token {k} (position {pos})", "a cache-off logprob", "none", False)
            cold_lp, cold_tok = entries[i][0], entries[i][1]
            best_lp, best_tok = (tops[i][0][0], tops[i][0][1]) if i < len(tops) and tops[i] else (cold_lp, cold_tok)
            where = f"output token {k} (position {pos})"
            if cold_tok != tok:
                return self.note(rid, f"{where}: the token the cache-off answer names there", tok, cold_tok, False)
            if cold_lp is None or cold_lp < best_lp - tol["tie_eps"]:
                return self.note(rid, where, f"{best_tok} (the cache-off argmax)", tok, False)
            if k < len(served) and served[k] is not None:
                gap = max(gap, abs(served[k] - cold_lp))
                if abs(served[k] - cold_lp) > tol["logprob_atol"]:
                    return self.note(rid, f"output logprob {k} (position {pos})", f"{cold_lp:.6g} (cache-off)", f"{served[k]:.6g}", False)
            first = first or (where, f"{tok} logprob {cold_lp:.6g} (cache-off)",
                              f"{tok} logprob {served[k]:.6g}" if k < len(served) and served[k] is not None else f"{tok}")
        self.note(rid, f"{first[0]}; all {len(out)} output tokens as the cache-off answer (largest logprob gap {gap:.2g})",
                  first[1], first[2], True)

    # ------------------------------------------------------------ the run
    def run(self):
        self.flush()
        for step in self.plan["steps"]:
            try:
                getattr(self, "step_" + step["op"])(step)
            except requests.RequestException as e:
                self.dead = self.dead or f"step {step['at']} ({step['op']}): {type(e).__name__}"
            if self.dead:
                break
        if not self.dead:
            self.wait_all()
            for sid in list(self.sessions):
                self.step_close({"sid": sid})
            self.judge_idle("end of the program")
        if self.dead and not any(f.what == "server" for f in self.findings):
            self.note("server", "server", "alive and answering", f"gone ({self.dead})", False)
        self.judge_answers()
        return self.findings


def main(plan, argv=None):
    p = argparse.ArgumentParser(description=plan["title"])
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the server under test (default: %(default)s)")
    p.add_argument("--cold-url", help="a server of the same model with --disable-radix-cache for the cache-off answers "
                   "(default: the same server, flushed before each)")
    args = p.parse_args(argv)
    print(f"{plan['title']}\nreplaying {len(plan['steps'])} steps against {args.url}")
    findings = Player(args.url, plan, args.cold_url).run()
    wrong = [f for f in findings if not f.ok]
    print(f"{len(wrong)} of {len(findings)} judged numbers differ from the expected ones: "
          + ("the bug reproduces" if wrong else "the bug does not reproduce here"))
    return 1 if wrong else 0
