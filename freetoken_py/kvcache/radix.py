"""Prefix cache over token ids at page granularity (a radix tree whose edges are whole pages).

    namespace root ──(t0..t15)──> node[page 7] ──(t16..t31)──> node[page 2] ──> ...
                                               └─(t16'..t31')─> node[page 9]      (a divergent turn)

Each node owns one full page and stores that page's token ids (never a bare hash), so a match is
exact. Only full pages are shared; the tokens after the last shared page are recomputed by the
request. Roots are namespaced by everything that changes KV content (model identity, KV dtype and
scales, the client's cache_salt), so two namespaces never see each other's pages.

Contract with the scheduler (which never touches nodes):
- `match` does not change refcounts; the caller `share`s the returned pages to lock them.
- The cache holds one allocator reference per node. A page is evictable when that is the only
  reference (no request holds it) and its node is a leaf; `evict` takes least-recently-used first.
- `insert` adopts the caller's pages for token pages not yet cached (taking a reference); pages
  already cached are left with the caller, which releases them as usual.

Models with windowed layers (window.py): a node may also hold the windowed layers' page of its
tokens (`insert(..., window_pages)`); `match` then stops at the deepest page boundary whose
window's pages are all held, and returns them (`MatchResult.window_pages`); eviction frees both.

Hybrid models (recurrent layers, snapshots.py): a node may also hold a snapshot of the recurrent
state after its page (`attach`). `match(..., with_state=True)` stops at the deepest matched node
that holds a valid one and returns it; a snapshot is freed with its node on eviction, and
`evict_snapshots` frees the least recently used ones alone when snapshot slots run out.
"""
from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Hashable, NamedTuple

from freetoken_py.kvcache.pool import PageAllocator

if TYPE_CHECKING:
    from freetoken_py.kvcache.snapshots import SnapshotStore


class MatchResult(NamedTuple):
    pages: list[int]  # cached pages of the longest matching prefix, in order
    num_tokens: int  # = len(pages) * page_size
    handle: object | None  # the deepest matched node (opaque)
    snapshot: object | None = None  # with_state: the recurrent-state snapshot at num_tokens
    # models with windowed layers (window.py): their pages of the match, positional, -1 behind the window
    window_pages: list[int] | None = None


class InsertResult(NamedTuple):
    num_new_pages: int  # pages the cache adopted
    num_cached_pages: int  # pages of the prefix that were already cached


class _Node:
    __slots__ = ("key", "page", "tag", "parent", "children", "last_access", "snap", "snap_used", "wpage", "wtag")

    def __init__(self, key: tuple[int, ...], page: int, parent: _Node | None, tag: int = -1):
        self.key, self.page, self.parent, self.tag = key, page, parent, tag
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = 0
        self.snap = None  # a snapshots.SnapshotRef of the recurrent state after this page, or None
        self.snap_used = 0  # when the snapshot was attached or last matched (its own LRU clock)
        self.wpage, self.wtag = -1, -1  # the windowed layers' page of the same tokens (window.py), or -1


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, snapshots: SnapshotStore | None = None):
        self.allocator = allocator
        self.page_size = page_size
        self.snapshots = snapshots  # hybrid models: where node snapshots live
        self.windows = None  # models with windowed layers: their pages' pool (window.WindowPages)
        self.num_windows_evicted = 0  # windowed pages given back alone (evict_windows)
        self._roots: dict[Hashable, _Node] = {}
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages held by the cache
        self.num_evicted = 0
        self.num_snapshots = 0  # nodes holding a snapshot
        self.num_snapshots_evicted = 0

    def _keys(self, tokens: list[int]) -> list[tuple[int, ...]]:
        S = self.page_size
        return [tuple(tokens[i:i + S]) for i in range(0, len(tokens) // S * S, S)]

    def match(self, namespace: Hashable, tokens: list[int], with_state: bool = False) -> MatchResult:
        """Longest cached prefix of `tokens` (whole pages). Marks the path recently used.
        with_state: the longest one ending at a node with a valid snapshot (none: an empty match)."""
        node, pages, now = self._roots.get(namespace), [], next(self._clock)
        if node is None:
            return MatchResult([], 0, None)
        best = (0, None)  # (pages, node) of the deepest snapshot
        for key in self._keys(tokens):
            child = node.children.get(key)
            if child is None or child.tag != self.allocator.tags_np[child.page]:
                break  # a stale node (its page changed hands) never matches
            node = child
            node.last_access = now
            pages.append(node.page)
            if with_state and node.snap is not None:
                if self.snapshots.valid(node.snap, namespace):
                    best = (len(pages), node)
                else:
                    self._drop_snapshot(node)  # its slot changed hands: it can never be restored
        if with_state:
            n, node = best
            if node is not None:
                node.snap_used = now
            return MatchResult(pages[:n], n * self.page_size, node, node.snap if node is not None else None)
        if self.windows is not None:
            return self._match_windowed(pages, node)
        return MatchResult(pages, len(pages) * self.page_size, node if pages else None)

    def _match_windowed(self, pages: list[int], node: _Node | None) -> MatchResult:
        """The deepest page boundary d of the match whose windowed rows are all cached: resuming
        at token N = d * page_size reads the windowed keys (N - window, N), in pages
        first_page(N) .. d - 1, which must be held by their nodes (a request keeps only its
        window's pages, so older nodes may have none)."""
        path = []
        while node is not None and node.parent is not None and len(path) < len(pages):
            path.append(node)
            node = node.parent
        path.reverse()
        tags = self.windows.allocator.tags_np
        wpages = [n.wpage if n.wpage >= 0 and n.wtag == tags[n.wpage] else -1 for n in path]
        d = len(pages)
        while d and any(p < 0 for p in wpages[self.windows.first_page(d * self.page_size):d]):
            d -= 1
        first = self.windows.first_page(d * self.page_size)
        return MatchResult(pages[:d], d * self.page_size, path[d - 1] if d else None, None,
                           [p if j >= first else -1 for j, p in enumerate(wpages[:d])])

    def attach(self, namespace: Hashable, tokens: list[int], snapshot) -> bool:
        """Keep `snapshot` (the recurrent state after the full pages of `tokens`, already
        inserted) on the node of the last page, replacing (and freeing) one already there. False
        when that path is not cached: the caller keeps the snapshot."""
        node = self._roots.get(namespace)
        keys = self._keys(tokens)
        for key in keys:
            node = node.children.get(key) if node is not None else None
        if node is None or not keys or node.tag != self.allocator.tags_np[node.page]:
            return False
        if node.snap is not None:
            self._drop_snapshot(node)
        node.snap = snapshot
        node.last_access = node.snap_used = next(self._clock)
        self.num_snapshots += 1
        return True

    def snapshot_at(self, namespace: Hashable, tokens: list[int]):
        """The valid snapshot on the node of the last full page of `tokens`, or None."""
        node = self._roots.get(namespace)
        for key in self._keys(tokens):
            node = node.children.get(key) if node is not None else None
        if node is None or node.snap is None or node.tag != self.allocator.tags_np[node.page]:
            return None
        return node.snap if self.snapshots.valid(node.snap, namespace) else None

    def drop_snapshot(self, handle) -> None:
        """Free the snapshot of a matched node (`MatchResult.handle`), e.g. one `restore` refused."""
        if handle is not None and handle.snap is not None:
            self._drop_snapshot(handle)

    def _drop_snapshot(self, node: _Node) -> None:
        self.snapshots.release(node.snap)
        node.snap = None
        self.num_snapshots -= 1

    def evict_snapshots(self, num: int) -> int:
        """Free up to `num` snapshots, least recently used first (their pages stay). Returns freed."""
        held = sorted((n for n in self._nodes() if n.snap is not None), key=lambda n: n.snap_used)[:num]
        for node in held:
            self._drop_snapshot(node)
        self.num_snapshots_evicted += len(held)
        return len(held)

    def insert(self, namespace: Hashable, tokens: list[int], pages: list[int],
               window_pages: list[int] | None = None) -> InsertResult:
        """Cache the full pages of `tokens`, whose K/V live in `pages` (the caller's page table);
        window_pages: the caller's windowed table (window.py), adopted by the nodes lacking one."""
        node = self._roots.setdefault(namespace, _Node((), -1, None))
        now, new, old = next(self._clock), 0, 0
        for j, (key, page) in enumerate(zip(self._keys(tokens), pages)):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, page, node, int(self.allocator.tags_np[page]))
                self.allocator.share([page])
                self.num_pages += 1
                new += 1
            else:
                old += 1
            if window_pages is not None and j < len(window_pages) and window_pages[j] >= 0:
                self._adopt_window(child, window_pages[j])
            child.last_access = now
            node = child
        return InsertResult(new, old)

    def _adopt_window(self, node: _Node, wpage: int) -> None:
        tags = self.windows.allocator.tags_np
        if node.wpage >= 0 and node.wtag == tags[node.wpage]:
            return   # it has one: the caller's stays the caller's
        self.windows.allocator.share([wpage])
        node.wpage, node.wtag = wpage, int(tags[wpage])

    def evict_windows(self, num_pages: int) -> int:
        """Give back up to `num_pages` windowed pages held only by the cache, least recently used
        nodes first (their full pages stay cached; a hit then stops before them). Returns freed."""
        if self.windows is None:
            return 0
        a = self.windows.allocator
        held = sorted((n for n in self._nodes() if n.wpage >= 0 and n.wtag == a.tags_np[n.wpage]
                       and a.refcount(n.wpage) == 1), key=lambda n: n.last_access)[:num_pages]
        for node in held:
            self._release_window(node)
        self.num_windows_evicted += len(held)
        return len(held)

    def _release_window(self, node: _Node) -> None:
        if node.wpage >= 0 and node.wtag == self.windows.allocator.tags_np[node.wpage]:
            self.windows.allocator.release([node.wpage])   # (a stale one is no longer ours to give back)
        node.wpage = node.wtag = -1

    def evictable_leaves(self) -> list[_Node]:
        return [n for n in self._nodes() if not n.children and self.allocator.refcount(n.page) == 1]

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages held only by the cache, LRU leaves first. Returns pages freed."""
        heap = [(n.last_access, id(n), n) for n in self.evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            if node.snap is not None:  # a snapshot goes with its node
                self._drop_snapshot(node)
                self.num_snapshots_evicted += 1
            self.allocator.release([node.page])
            if self.windows is not None:
                self._release_window(node)
            self.num_pages -= 1
            self.num_evicted += 1
            freed += 1
            if parent.parent is not None and not parent.children and self.allocator.refcount(parent.page) == 1:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self._drop_empty_roots()
        return freed

    def move_pages(self, moves: dict[int, int]) -> int:
        """The K/V of cached page `old` now lives in page `new` (the caller copied it and holds
        `new` for the cache): the nodes point at the new pages and take their tags. The old pages
        are the caller's to release. Returns the nodes moved."""
        moved = 0
        for node in self._nodes():
            new = moves.get(node.page)
            if new is not None:
                # a node already stale (its page changed hands before) stays stale: it must not
                # start matching the new page, which holds someone else's K/V
                fresh = node.tag == self.allocator.tags_np[node.page]
                node.page, node.tag = new, int(self.allocator.tags_np[new]) if fresh else -1
                moved += 1
        return moved

    def cached_pages(self) -> list[int]:
        return [n.page for n in self._nodes()]

    def _nodes(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node

    def _drop_empty_roots(self) -> None:
        for ns in [ns for ns, r in self._roots.items() if not r.children]:
            del self._roots[ns]
