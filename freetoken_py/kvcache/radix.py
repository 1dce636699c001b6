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
"""
from __future__ import annotations

import heapq
import itertools
from typing import Hashable, NamedTuple

from freetoken_py.kvcache.pool import PageAllocator


class MatchResult(NamedTuple):
    pages: list[int]  # cached pages of the longest matching prefix, in order
    num_tokens: int  # = len(pages) * page_size
    handle: object | None  # the deepest matched node (opaque)


class InsertResult(NamedTuple):
    num_new_pages: int  # pages the cache adopted
    num_cached_pages: int  # pages of the prefix that were already cached


class _Node:
    __slots__ = ("key", "page", "tag", "parent", "children", "last_access")

    def __init__(self, key: tuple[int, ...], page: int, parent: _Node | None, tag: int = -1):
        self.key, self.page, self.parent, self.tag = key, page, parent, tag
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = 0


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self._roots: dict[Hashable, _Node] = {}
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages held by the cache
        self.num_evicted = 0

    def _keys(self, tokens: list[int]) -> list[tuple[int, ...]]:
        S = self.page_size
        return [tuple(tokens[i:i + S]) for i in range(0, len(tokens) // S * S, S)]

    def match(self, namespace: Hashable, tokens: list[int]) -> MatchResult:
        """Longest cached prefix of `tokens` (whole pages). Marks the path recently used."""
        node, pages, now = self._roots.get(namespace), [], next(self._clock)
        if node is None:
            return MatchResult([], 0, None)
        for key in self._keys(tokens):
            child = node.children.get(key)
            if child is None or child.tag != self.allocator.tags_np[child.page]:
                break  # a stale node (its page changed hands) never matches
            node = child
            node.last_access = now
            pages.append(node.page)
        return MatchResult(pages, len(pages) * self.page_size, node if pages else None)

    def insert(self, namespace: Hashable, tokens: list[int], pages: list[int]) -> InsertResult:
        """Cache the full pages of `tokens`, whose K/V live in `pages` (the caller's page table)."""
        node = self._roots.setdefault(namespace, _Node((), -1, None))
        now, new, old = next(self._clock), 0, 0
        for key, page in zip(self._keys(tokens), pages):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, page, node, int(self.allocator.tags_np[page]))
                self.allocator.share([page])
                self.num_pages += 1
                new += 1
            else:
                old += 1
            child.last_access = now
            node = child
        return InsertResult(new, old)

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
            self.allocator.release([node.page])
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
