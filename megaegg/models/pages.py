"""The page pool of a paged KV cache (``build_step_graph(..., page_len=, pages=)``): which pages hold which
sequence's rows, and the whole pages of prompts that later requests may share.

A sequence holds a list of pages, its row of the page table; position ``p`` is row ``p % page_len`` of its
page ``p // page_len``. :meth:`PagePool.admit` gives a new sequence the pages of its prompt (if ``keep``
pages stay available beside them: the batcher's headroom for the running sequences to grow) and
:meth:`PagePool.grow` more as it writes rows (the batcher preempts another sequence when none is left); a
request that could never fit is refused when it is submitted.

Prefix sharing: a page whose rows a sequence has written in full is indexed by its tokens and the page
before it (``(parent page, its epoch, tokens)``: a chain, so equal pages after different prefixes differ;
a page whose key another page holds already is a duplicate, left unindexed, and the next one is keyed on
the indexed twin). A page's epoch moves on each time it is taken, so an entry keyed on an earlier use of
its parent never matches again.
A new request starts with the longest chain of indexed pages that its prompt begins with (all but its last
token: the first launch computes that one's logits), those pages shared (reference counts), and prefills
only the rest. A released sequence's indexed pages stay cached until a new page is needed and none is
free: then the least recently used page no sequence holds is taken (its epoch moves on, so index entries
that name it as a parent no longer match).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..graph import GraphError


@dataclass
class SequencePages:
    """One sequence's pages, in order, and how many of its leading pages are indexed (shared or sharable)."""

    pages: list[int] = field(default_factory=list)
    indexed: int = 0
    chain: int = -1  # the indexed page holding the rows of its last indexed one (its next page's key parent)
    chain_epoch: int = 0  # that page's epoch then (taken by another sequence since: the key no longer matches)


class PagePool:
    """``count`` pages of ``page_len`` rows, a sequence at most ``per_seq`` of them."""

    def __init__(self, count: int, page_len: int, per_seq: int, *, prefix_cache: bool = True) -> None:
        for what, v in (("pages", count), ("page_len", page_len), ("pages a sequence", per_seq)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise GraphError(f"{what} must be an int >= 1, got {v!r}")
        self.count, self.page_len, self.per_seq, self.prefix_cache = count, page_len, per_seq, prefix_cache
        self.free: list[int] = list(range(count - 1, -1, -1))  # (popped from the end: page 0 first)
        self.refs = [0] * count
        self.epoch = [0] * count
        self.key_of: dict[int, tuple] = {}  # indexed page -> its key
        self.index: dict[tuple, int] = {}  # key -> indexed page
        self.cached: OrderedDict[int, None] = OrderedDict()  # indexed pages no sequence holds, least recent first
        self.shared_tokens = 0  # prompt tokens whose rows came from shared pages

    # --- capacity -----------------------------------------------------------------------------------
    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_len)

    def fits_ever(self, rows: int) -> bool:
        """Whether a sequence of ``rows`` rows can ever be held (the pool and a table row hold its pages)."""
        return self.pages_for(rows) <= min(self.count, self.per_seq)

    def available(self) -> int:
        """Pages a new sequence can take now: free ones and cached ones no sequence holds."""
        return len(self.free) + len(self.cached)

    # --- a sequence's life --------------------------------------------------------------------------
    def admit(self, prompt: list[int], rows: int, *, keep: int = 0) -> tuple[SequencePages, int] | None:
        """Pages for a new sequence's first ``rows`` rows (its prompt's: the batcher grows it later) and how
        many prompt tokens shared pages already hold (whole pages, at most all but the last token); None if
        the pool cannot hold them now with ``keep`` pages still available after (the request waits; nothing
        is taken)."""
        shared = self._shared_prefix(prompt)
        need = self.pages_for(rows) - len(shared)
        # (a shared page that is cached, no sequence holding it, stops being available once taken)
        if need + keep > self.available() - sum(1 for p in shared if p in self.cached):
            return None
        seq = SequencePages()
        for p in shared:
            self._hold(p)
            seq.pages.append(p)
        seq.indexed, seq.chain = len(shared), shared[-1] if shared else -1
        seq.chain_epoch = self.epoch[seq.chain] if shared else 0
        for _ in range(need):
            seq.pages.append(self._take())
        self.shared_tokens += len(shared) * self.page_len
        return seq, len(shared) * self.page_len

    def grow(self, seq: SequencePages, rows: int) -> bool:
        """Pages for the sequence's first ``rows`` rows (False, and nothing taken, if the pool has too few)."""
        need = self.pages_for(rows) - len(seq.pages)
        if need > self.available():
            return False
        for _ in range(need):
            seq.pages.append(self._take())
        return True

    def written(self, seq: SequencePages, tokens: list[int], fed: int) -> None:
        """The sequence's rows ``[0, fed)`` hold ``tokens[:fed]``: index its pages that became whole."""
        if not self.prefix_cache:
            return
        while seq.indexed < len(seq.pages) and (seq.indexed + 1) * self.page_len <= fed:
            j = seq.indexed
            page = seq.pages[j]
            key = (seq.chain, seq.chain_epoch, tuple(tokens[j * self.page_len:(j + 1) * self.page_len]))
            if key not in self.index:
                self.index[key], self.key_of[page] = page, key
            seq.chain = self.index[key]  # (this page, or its indexed twin: a duplicate stays unindexed)
            seq.chain_epoch = self.epoch[seq.chain]
            seq.indexed += 1

    def release(self, seq: SequencePages) -> None:
        """The sequence ended: its pages go back (indexed ones stay cached for later prompts). Its last page is
        released first, so it is the first evicted: a prefix's head, on which its later pages are keyed, goes
        last (evicting the head first would strand every page after it)."""
        for p in reversed(seq.pages):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self.key_of:
                    self.cached[p] = None
                else:
                    self.free.append(p)
        seq.pages.clear()

    def table_row(self, seq: SequencePages) -> list[int]:
        """The sequence's row of the page table (unused entries -1: never read, and a body that did would
        report it)."""
        return seq.pages + [-1] * (self.per_seq - len(seq.pages))

    # --- internals ----------------------------------------------------------------------------------
    def _key(self, parent: int, tokens: list[int]) -> tuple:
        return (parent, self.epoch[parent] if parent >= 0 else 0, tuple(tokens))

    def _shared_prefix(self, prompt: list[int]) -> list[int]:
        if not self.prefix_cache:
            return []
        pages, parent = [], -1
        for j in range((len(prompt) - 1) // self.page_len):  # (whole pages before the last token)
            page = self.index.get(self._key(parent, prompt[j * self.page_len:(j + 1) * self.page_len]))
            if page is None:
                break
            pages.append(page)
            parent = page
        return pages

    def _hold(self, p: int) -> None:
        self.cached.pop(p, None)
        self.refs[p] += 1

    def _take(self) -> int:
        """A page for new rows: a free one, else the least recently released cached one (unindexed)."""
        if self.free:
            p = self.free.pop()
        else:
            p, _ = self.cached.popitem(last=False)
            del self.index[self.key_of.pop(p)]
        self.epoch[p] += 1  # (entries keyed on the page's earlier rows no longer match)
        self.refs[p] = 1
        return p
