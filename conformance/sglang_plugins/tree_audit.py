"""The tree audit: SGLang's radix tree read after every batch and at idle, judged by rules.

The observe plugin (``conformance/sglang_plugins/observe.py``) calls :func:`audit` before each
batch runs (the tree as the previous step's results and this step's scheduling left it) and
at each idle publish.  An audit reads the tree into a :class:`TreeView` (:func:`read_tree`:
what the tree's core lets the kit read), runs every :data:`RULES` entry whose inputs the view
has, and SGLang's own ``sanity_check`` where the tree has one (its ``AssertionError`` is a
violation of the rule ``sglang_sanity_check``).  A violation names its rule and the node's
path: the lengths, in tokens, of the keys from the root down to the node (``64/16``: a node of
16 tokens under one of 64).  Each one is written once per tree generation (until the next
reset) as a ``tree_violation`` record of the per-request file; the programs' oracle and the
leaks suite turn it into a ``tree_structure`` finding.

What a core lets the kit read: the Python core of ``UnifiedRadixCache`` (and every tree whose
nodes are Python objects) gives every node; SGLang 0.5.23's Rust core gives no node
(``root_node`` raises ``NotImplementedError``), only its mamba values
(``all_mamba_values_flatten``), its protected sizes and its own ``sanity_check``: the audit's
``rules`` record (:func:`rules_line`) says which rules ran on which tree.

Pure apart from :func:`read_tree` and :func:`audit` (they read SGLang's objects, never change them).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

#: The rule SGLang's own check is recorded under (not in :data:`RULES`: it runs on the cache, not on a view).
SGLANG_RULE = "sglang_sanity_check"
#: The rule judged at each insert rather than on a view (:func:`state_position`).
STATE_POSITION_RULE = "state_position"


@dataclass(frozen=True)
class NodeView:
    """One non-root node as the audit reads it."""

    path: tuple[int, ...]  # key lengths from the root's child down to this node
    under_own_key: bool  # its parent's children hold it under its own first page (child key)
    locks: Mapping[str, int]  # component -> lock count
    mamba: tuple[int, ...] = ()  # the mamba pool slots its value names (empty: none)
    in_mamba_lru: bool | None = None  # in the tree's mamba LRU list (None: the tree keeps none)

    @property
    def depth(self) -> int:
        return sum(self.path)


@dataclass(frozen=True)
class TreeView:
    """What one audit read of one tree; a field None was not readable on this tree (the rules
    that need it do not run)."""

    tree: str  # the tree class and core (``UnifiedRadixCache/python``)
    page_size: int
    idle: bool  # no request runs or waits, and no session holds the tree
    nodes: tuple[NodeView, ...] | None = None
    lru_strays: int | None = None  # mamba LRU entries naming no node of the tree
    tree_slots: tuple[int, ...] | None = None  # every mamba slot the tree's values name (with repeats)
    free_slots: frozenset[int] | None = None  # the mamba allocator's free slots
    request_slots: Mapping[str, tuple[int, ...]] | None = None  # running request -> its own mamba slots
    state_lens: Mapping[int, int] | None = None  # slot -> prefix length the tree took it for (observe's state_stored)
    protected: Mapping[str, int] | None = None  # component -> protected (locked) size the tree counts
    #: slots the allocator counts used that neither the tree nor any request the scheduler holds
    #: names (None: not readable, or owners the audit cannot see: a session holding the tree, PD
    #: queues, a host tier)
    unowned: frozenset[int] | None = None
    reserved: frozenset[int] | None = None  # the unowned slots of the server's first idle audit (its padding slots)


@dataclass(frozen=True)
class Violation:
    """One broken rule: its name, the node's path (empty: the tree as a whole) and what was seen."""

    rule: str
    path: tuple[int, ...]
    line: str

    def where(self) -> str:
        return "/".join(map(str, self.path)) or "tree"

    def to_json(self) -> dict[str, Any]:
        return {"ev": "tree_violation", "rule": self.rule, "path": "/".join(map(str, self.path)), "line": self.line}


@dataclass(frozen=True)
class Rule:
    """One rule of the audit: what it holds, the view fields it needs, and its check."""

    name: str
    summary: str
    needs: tuple[str, ...]
    check: Callable[[TreeView], list[Violation]] = field(repr=False)

    def runs_on(self, view: TreeView) -> bool:
        return all(getattr(view, f) is not None for f in self.needs)


def _key_pages(v: TreeView) -> list[Violation]:
    return [Violation("key_pages", n.path, f"key of {n.path[-1]} tokens is not a positive whole number of pages of {v.page_size}")
            for n in v.nodes if n.path[-1] <= 0 or n.path[-1] % v.page_size]


def _child_key(v: TreeView) -> list[Violation]:
    return [Violation("child_key", n.path, "its parent's children do not hold it under its own first page")
            for n in v.nodes if not n.under_own_key]


def _lock_negative(v: TreeView) -> list[Violation]:
    return [Violation("lock_negative", n.path, f"{c} lock count {k}") for n in v.nodes for c, k in n.locks.items() if k < 0]


def _lock_at_idle(v: TreeView) -> list[Violation]:
    if not v.idle:
        return []
    return [Violation("lock_at_idle", n.path, f"{c} lock count {k} while idle") for n in v.nodes for c, k in n.locks.items() if k > 0]


def _protected_at_idle(v: TreeView) -> list[Violation]:
    if not v.idle:
        return []
    return [Violation("protected_at_idle", (), f"{c} protected size {k} while idle") for c, k in v.protected.items() if k > 0]


def _lru_exact(v: TreeView) -> list[Violation]:
    out = [Violation("lru_exact", n.path, "holds a mamba value but is not in the mamba LRU list" if n.mamba
                     else "in the mamba LRU list without a mamba value")
           for n in v.nodes if n.in_mamba_lru is not None and bool(n.mamba) != n.in_mamba_lru]
    if v.lru_strays:
        out.append(Violation("lru_exact", (), f"{v.lru_strays} mamba LRU entr(y/ies) name no node of the tree"))
    return out


def _slot_used(v: TreeView) -> list[Violation]:
    paths = _slot_paths(v)
    return [Violation("slot_used", paths.get(s, ()), f"mamba slot {s} is the tree's but its allocator counts it free")
            for s in sorted(set(v.tree_slots) & v.free_slots)]


def _slot_once(v: TreeView) -> list[Violation]:
    paths = _slot_paths(v)
    held = Counter(v.tree_slots)
    for slots in v.request_slots.values():
        held.update(set(slots))
    return [Violation("slot_once", paths.get(s, ()), f"mamba slot {s} is held {n} times (tree nodes and running requests)" + _holders(v, s))
            for s, n in sorted(held.items()) if n > 1]


def _holders(v: TreeView, slot: int) -> str:
    """Who holds a slot held twice: the tree's count and the requests naming it."""
    reqs = [r for r, slots in v.request_slots.items() if slot in slots]
    return f": {v.tree_slots.count(slot)} by the tree, by request {', '.join(reqs)}" if reqs else ""


def _slot_owned(v: TreeView) -> list[Violation]:
    return [Violation("slot_owned", (), f"mamba slot {s} is counted used by its allocator but no tree node and no request holds it")
            for s in sorted(v.unowned - v.reserved)]


def _state_depth(v: TreeView) -> list[Violation]:
    return [Violation("state_depth", n.path, f"its mamba state (slot {s}) was taken for {v.state_lens[s]} tokens, the node's depth is {n.depth}")
            for n in v.nodes for s in n.mamba if s in v.state_lens and v.state_lens[s] != n.depth]


def _slot_paths(v: TreeView) -> dict[int, tuple[int, ...]]:
    return {s: n.path for n in v.nodes or () for s in n.mamba}


#: Every rule of the kit's audit, in the order they run.
RULES: tuple[Rule, ...] = (
    Rule("key_pages", "each non-root node has a non-empty key of whole pages", ("nodes",), _key_pages),
    Rule("child_key", "each non-root node sits in its parent's children under its own first page", ("nodes",), _child_key),
    Rule("lock_negative", "no lock count is negative", ("nodes",), _lock_negative),
    Rule("lock_at_idle", "at idle (no session holding the tree) every lock count is 0", ("nodes",), _lock_at_idle),
    Rule("protected_at_idle", "at idle the tree's protected (locked) sizes are 0", ("protected",), _protected_at_idle),
    Rule("lru_exact", "the mamba LRU list holds exactly the nodes that hold a mamba value", ("nodes", "lru_strays"), _lru_exact),
    Rule("slot_used", "every mamba slot the tree holds is one its allocator counts as used", ("tree_slots", "free_slots"), _slot_used),
    Rule("slot_once", "no mamba slot is held twice (tree nodes and running requests)", ("tree_slots", "request_slots"), _slot_once),
    Rule("slot_owned", "every mamba slot the allocator counts used is held by a tree node or a request", ("unowned", "reserved"), _slot_owned),
    Rule("state_depth", "a node's mamba state was taken for a prefix as long as the node's depth", ("nodes", "state_lens"), _state_depth),
)
RULE_NAMES = (*(r.name for r in RULES), SGLANG_RULE, STATE_POSITION_RULE)


def state_position(key_len: int, rid: str, tracked: tuple[int, ...], page_size: int = 1) -> Violation | None:
    """Rule ``state_position``, judged when the tree takes a mamba state from a request: the
    state was computed at the length it is keyed by, i.e. the key is as long as one of the
    positions the request tracked its checkpoints at (``tracked``: its last and previous
    tracked lengths, ``mamba_last_track_seqlen`` and ``mamba_prev_track_seqlen``). A state
    keyed shorter than it was computed at is a later prefix's state: a hit there resumes past
    the tokens it then computes again. The line says when the key is a tracked length's page
    floor (a tracked length off the ``page_size`` grid). None when it holds (or the request
    tracked nothing)."""
    if not tracked or key_len in tracked:
        return None
    at = " or ".join(map(str, tracked))
    floor = next((t for t in tracked if t % page_size and t // page_size * page_size == key_len), None)
    why = f" (the page floor of {floor}: it is off the {page_size}-token page grid)" if floor is not None else ""
    return Violation(STATE_POSITION_RULE, (key_len,),
                     f"the tree took request {rid}'s mamba state under a {key_len}-token key, but the request tracked "
                     f"its state at {at} tokens{why}: the node holds another prefix's state")


def judge(view: TreeView) -> tuple[list[Violation], list[str]]:
    """Run every rule the view can feed: (violations, names of the rules that ran)."""
    ran = [r for r in RULES if r.runs_on(view)]
    return [v for r in ran for v in r.check(view)], [r.name for r in ran]


# ------------------------------------------------------------------ reading SGLang's tree
def _slots(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(x) for x in (value.reshape(-1).tolist() if hasattr(value, "reshape") else value))


def _python_nodes(core: Any, page_size: int) -> tuple[tuple[NodeView, ...], int | None]:
    """Every non-root node of a unified tree whose nodes are Python objects (``component_data``
    per component: ``UnifiedTreeCore`` from 0.5.18, the ``UnifiedRadixCache`` itself before),
    and the mamba LRU entries naming none.  A tree of another shape (``MambaRadixCache``, the
    Rust core) raises: its nodes are not read, the audit runs the rules its mamba values feed."""
    try:
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    except ImportError:  # up to 0.5.17 the components live in unified_cache_components
        from sglang.srt.mem_cache.unified_cache_components.tree_component import ComponentType

    # the core names its components component_types (0.5.18 on); the older tree, tree_components
    cts = tuple(getattr(core, "component_types", None) or getattr(core, "tree_components", None) or ())
    if not cts:  # never read every node as holding nothing
        raise AttributeError(f"{type(core).__name__} names no components")
    mamba = ComponentType.MAMBA
    lru = getattr(core, "lru_lists", {}).get(mamba) if hasattr(core, "lru_lists") else None
    lru_ids = set(lru.cache.keys()) if lru is not None else None
    nodes: list[NodeView] = []
    ids: set[int] = set()
    stack = [(child, ()) for child in core.root_node.children.values()]
    while stack:
        node, above = stack.pop()
        path = (*above, len(node.key))
        parent = node.parent
        under = parent is not None and parent.children.get(node.key.child_key(page_size)) is node
        locks = {ct.name.lower(): int(node.component_data[ct].lock_ref) for ct in cts}
        value = node.component_data[mamba].value if mamba in cts else None
        ids.add(node.id)
        nodes.append(NodeView(path, under, locks, _slots(value), None if lru_ids is None else node.id in lru_ids))
        stack.extend((c, path) for c in node.children.values())
    return tuple(nodes), (len(lru_ids - ids) if lru_ids is not None else None)


def _mamba_allocator(scheduler: Any) -> Any:
    """The scheduler's mamba slot allocator (the pool itself on releases without a separate one)."""
    pool = scheduler.req_to_token_pool
    return getattr(pool, "mamba_allocator", None) or getattr(pool, "mamba_pool", None)


def _slot_holder(req: Any) -> Any:
    """Where a request keeps its mamba slot fields: ``req.kv`` where the release has them there, else the request."""
    return req.kv if hasattr(getattr(req, "kv", None), "mamba_pool_idx") else req


def _free_slots(scheduler: Any) -> frozenset[int] | None:
    free = getattr(_mamba_allocator(scheduler), "free_slots", None)
    return None if free is None else frozenset(_slots(free))


def _request_slots(scheduler: Any, batch: Any) -> dict[str, tuple[int, ...]]:
    """Each unfinished request's own mamba slots, keyed by its rid and where it sits.  A
    finished request is left out: SGLang's ``cleanup_after_caching_req`` (no_buffer) donates
    a finished request's slot to the tree and leaves ``mamba_pool_idx`` naming it, and the
    finished request can still sit in the running batch until the next filter; its slot is
    the tree's (``slot_used`` and the idle invariant judge where it went)."""
    placed: dict[int, tuple[Any, str]] = {}  # id -> (request, where it sits)
    for where, group in (("running", getattr(getattr(scheduler, "running_batch", None), "reqs", ())),
                         ("this batch", getattr(batch, "reqs", None) or ())):
        for r in group:
            placed.setdefault(id(r), (r, where))
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        placed[id(chunked)] = (chunked, "chunked")
    out = {}
    for r, where in placed.values():
        finished = getattr(r, "finished", None)
        if callable(finished) and finished():
            continue
        out[f"{r.rid} ({where})"] = _slots(getattr(_slot_holder(r), "mamba_pool_idx", None))
    return out


def _any_request_slots(scheduler: Any, batch: Any) -> frozenset[int]:
    """Every mamba slot a request object the scheduler holds names (running, this batch, the
    last batch and those awaiting their results, the chunked request, the waiting queue;
    finished or not): a slot so named has an owner."""
    groups = [getattr(getattr(scheduler, "running_batch", None), "reqs", None), getattr(batch, "reqs", None),
              getattr(getattr(scheduler, "last_batch", None), "reqs", None), getattr(getattr(scheduler, "cur_batch", None), "reqs", None),
              [getattr(scheduler, "chunked_req", None)], getattr(scheduler, "waiting_queue", None)]
    groups += [getattr(item[0], "reqs", None) for item in getattr(scheduler, "result_queue", None) or () if isinstance(item, tuple) and item]
    out: set[int] = set()
    for group in groups:
        for r in group or ():
            if r is None:
                continue
            holder = _slot_holder(r)
            for name in ("mamba_pool_idx", "mamba_ping_pong_track_buffer", "mamba_cow_src_index"):
                out.update(s for s in _slots(getattr(holder, name, None)) if s >= 0)
    return frozenset(out)


def _unowned(scheduler: Any, batch: Any, tree_slots: tuple[int, ...], free: frozenset[int] | None, owners_seen: bool) -> frozenset[int] | None:
    """The slots counted used with no owner the audit can see (None: it cannot see them all)."""
    if free is None or not owners_seen or tree_slots is None:
        return None
    size = int(getattr(_mamba_allocator(scheduler), "size"))
    universe = frozenset(range(size + 1))  # 0..size: both slot conventions (0 or size reserved) fall in the padding
    return universe - free - frozenset(tree_slots) - _any_request_slots(scheduler, batch)


def tree_label(cache: Any) -> str:
    """The tree class and its core, as the audit's records name a tree (``UnifiedRadixCache/python``)."""
    core = getattr(cache, "tree_core", cache)  # MambaRadixCache keeps its nodes itself
    backend = "python" if type(core).__module__.startswith("sglang.srt.mem_cache.unified_cache") else (
        "rust" if "rust" in type(core).__module__ else type(core).__name__)
    return f"{type(cache).__name__}/{backend}"


def read_tree(scheduler: Any, batch: Any, *, idle: bool, state_lens: Mapping[int, int]) -> TreeView:
    """The scheduler's tree as the audit reads it (what its core lets it read)."""
    cache = scheduler.tree_cache
    core = getattr(cache, "tree_core", cache)  # MambaRadixCache keeps its nodes itself
    page_size = int(getattr(cache, "page_size", 1) or 1)
    session = getattr(cache, "session", None)
    if session is None and callable(getattr(cache, "any_holding_kv", None)):
        session = cache  # up to 0.5.18 the streaming-session wrapper is the tree cache itself
    held = bool(session is not None and getattr(session, "any_holding_kv", lambda: False)())
    view: dict[str, Any] = {"tree": tree_label(cache), "page_size": page_size, "idle": idle and not held}
    try:
        nodes, strays = _python_nodes(core, page_size)
        view.update(nodes=nodes, lru_strays=strays, tree_slots=tuple(s for n in nodes for s in n.mamba), state_lens=dict(state_lens))
    except (NotImplementedError, AttributeError, ImportError):  # the Rust core (or a tree of another shape) gives no node: its mamba values only
        flat = getattr(cache, "all_mamba_values_flatten", None)
        if flat is not None:
            view["tree_slots"] = _slots(flat())
    for name, read in (("free_slots", lambda: _free_slots(scheduler)), ("request_slots", lambda: _request_slots(scheduler, batch)),
                       ("protected", lambda: {"full": int(cache.full_protected_size()), "mamba": int(cache.mamba_protected_size())})):
        try:
            view[name] = read()
        except Exception:  # a release without that field: the rules needing it do not run
            view[name] = None
    # every owner visible: no session holds the tree, no PD queue, no host tier staging slots
    mode = getattr(scheduler, "disaggregation_mode", None)
    # and a tree the reader knows (the unified tree's Python or Rust core, 0.5.18 on: where the
    # request and session fields it reads are the ones that hold slots)
    owners_seen = (view["tree"].rsplit("/", 1)[1] in ("python", "rust") and not held and (mode is None or str(getattr(mode, "value", mode)).lower() == "null")
                   and not getattr(cache, "enable_storage", False) and getattr(cache, "cache_controller", None) is None
                   and not type(cache).__name__.startswith("Hi"))
    try:
        view["unowned"] = _unowned(scheduler, batch, view.get("tree_slots"), view["free_slots"], owners_seen)
    except Exception:  # an allocator without a size: the rule does not run
        view["unowned"] = None
    return TreeView(**view)


def sglang_check(cache: Any, *, idle: bool = True) -> list[Violation] | None:
    """SGLang's own ``sanity_check`` of the tree (where it has one): its assertion is a violation.
    None: the tree has none (a streaming-session wrapper forwards the call to a cache without
    one, e.g. the ``ChunkCache`` of ``--disable-radix-cache``, and that raises AttributeError),
    or a check that only holds at idle refused a busy tree (``MambaRadixCache`` up to 0.5.18
    raises a plain Exception on any lock: "x_lru should not be locked when idle")."""
    check = getattr(cache, "sanity_check", None)
    if check is None:
        return None
    try:
        check()
    except AttributeError:
        return None
    except AssertionError as e:
        return [_sglang_violation(e)]
    except Exception as e:  # not an assertion: SGLang's check of an idle tree
        return [_sglang_violation(e)] if idle else None
    return []


def _sglang_violation(e: BaseException) -> Violation:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return Violation(SGLANG_RULE, (), "; ".join(lines[:4])[:400] or type(e).__name__)


@dataclass
class Auditor:
    """The audits of one server: counts, cost, the violations already written (once per tree
    generation), the rules that ran per tree."""

    audits: int = 0
    seconds: float = 0.0
    seen: set[tuple[str, tuple[int, ...], str]] = field(default_factory=set)
    ran: dict[str, tuple[str, ...]] = field(default_factory=dict)  # tree -> the rules that have run on it
    failed: str = ""  # why an audit could not run (written once)
    reserved: frozenset[int] | None = None  # the unowned slots of the first idle audit (padding; see ``slot_owned``)

    def run(self, scheduler: Any, batch: Any, *, idle: bool, state_lens: Mapping[int, int]) -> list[Violation]:
        """One audit: the violations not written before (the caller writes them)."""
        t0 = time.perf_counter()
        view = read_tree(scheduler, batch, idle=idle, state_lens=state_lens)
        if self.reserved is None and view.idle and view.unowned is not None:
            self.reserved = view.unowned  # the padding slots, before any request could leak one
        view = replace(view, reserved=self.reserved)
        found, ran = judge(view)
        own = sglang_check(scheduler.tree_cache, idle=view.idle)
        if own is not None:
            found += own
            ran.append(SGLANG_RULE)
        self.audits += 1
        self.seconds += time.perf_counter() - t0
        new = self._new(found)
        before = self.ran.get(view.tree, ())
        if set(ran) - set(before):  # the rules that have run on this tree grew (one that stops for a while, e.g.
            # ``slot_owned`` while a session holds the tree, is not written again and again)
            self.ran[view.tree] = tuple(r for r in RULE_NAMES if r in {*before, *ran})
            return [*new, rules_line(view.tree, list(self.ran[view.tree]))]  # type: ignore[list-item]
        return new

    def judged(self, tree: str, rule: str) -> list["RulesLine"]:
        """A rule judged outside :meth:`run` (:data:`STATE_POSITION_RULE`, at an insert) ran on
        ``tree``: the rules line when that grew the tree's rules, else nothing."""
        before = self.ran.get(tree, ())
        if rule in before:
            return []
        self.ran[tree] = tuple(r for r in RULE_NAMES if r in {*before, rule})
        return [rules_line(tree, list(self.ran[tree]))]

    def _new(self, found: list[Violation]) -> list[Violation]:
        """The violations not written since the last reset (a broken node stays broken: once is enough)."""
        new = [v for v in found if (v.rule, v.path, v.line) not in self.seen]
        self.seen.update((v.rule, v.path, v.line) for v in new)
        return new

    def reset(self) -> None:
        """A new tree generation (a flush): violations seen before may be written again."""
        self.seen.clear()


@dataclass(frozen=True)
class RulesLine:
    """Which rules have run on a tree (written whenever that set grows)."""

    tree: str
    rules: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"ev": "tree_audit_rules", "tree": self.tree, "rules": list(self.rules),
                "not_run": [r for r in RULE_NAMES if r not in self.rules]}


def rules_line(tree: str, ran: list[str]) -> RulesLine:
    return RulesLine(tree, tuple(ran))
