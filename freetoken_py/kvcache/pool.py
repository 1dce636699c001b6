"""Fixed-size KV pages and who owns them.

Layout of one layer's cache (two rows per slot, shaped by the layer's state spec, spec.py)::

    k[layer] : [num_pages * page_size, *spec.rows[0]]   (paged K/V: [Hkv, hd]; MLA latent: [1, latent])
    v[layer] : [num_pages * page_size, *spec.rows[1]]   (paged K/V: [Hkv, hd]; MLA rope key: [1, rope])
    k[layer], v[layer] of a windowed layer (spec.PagedWindowKV): [window_pages * page_size, Hkv, hd],
                its own pool, addressed by the request's windowed table (window.WindowPages)
    index[index_layer[layer]] : [num_pages * page_size, 1, index_dim]   (DSA index keys; only the layers
                whose spec is paged_indexed_latent have one; never FP8: bf16 under an FP8 cache)
    slot      = page_id * page_size + offset          (flat index into the view [P*S, H, D])
    token pos -> page_table[pos // page_size], offset pos % page_size

A request's page table is a plain list of page ids owned by the request; the allocator only hands
out and takes back ids (with reference counts, so the prefix cache can share pages). Every page
carries a generation tag, bumped whenever the page is handed out or returned to the free list, so
a holder can prove the page is still the one it was given (see tags.py).

FP8 storage (`kv_dtype=torch.float8_e4m3fn`): values are stored as e4m3 bit patterns in uint8
tensors (CPU index_copy_ has no float8 kernel) with one fp32 scale per (layer, row head), calibrated
from the first write to each layer (LLM makes that a prefill of real text) or set from a file
(`set_scales`), and fixed afterwards, so a page never needs rescaling; values beyond the range
saturate and are counted (`clipped_per_layer`).
"""
from __future__ import annotations

import heapq
import math

import numpy as np
import torch

from freetoken_py.kvcache.spec import INDEX_FP8_DTYPE, PagedKV, PagedLatent, StateSpec, page_bytes, window_of


class OutOfPagesError(RuntimeError):
    """Not enough free pages; the scheduler preempts or waits."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        # a min-heap: the lowest free id goes first, so pages above a size the cache may shrink back
        # to stay free while the pages below suffice
        self._free = list(range(num_pages))
        self._refcount = [0] * num_pages
        # [P] generation of each physical page; numpy owns the memory because a scalar update costs
        # ~0.5 us there and ~50 us as a torch op; `tags` is a zero-copy torch view of the same array
        self.tags_np = np.zeros(num_pages, dtype=np.int64)
        self.tags = torch.from_numpy(self.tags_np)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
            self.tags_np[p] += 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refcount[p] > 0, f"page {p} is free"
            self._refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refcount[p] > 0, f"double free of page {p}"
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                heapq.heappush(self._free, p)
                self.tags_np[p] += 1  # a stale holder now fails its tag check even before reuse

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def grow(self, num_pages: int) -> None:
        """Hand out page ids up to `num_pages` from now on (the KV tensors grew to match). Held
        pages, their tags and the free list are kept; an id never used before starts at tag 0,
        one a `shrink` dropped goes on from the tag it was dropped with."""
        if num_pages <= self.num_pages:
            return
        for p in range(self.num_pages, num_pages):   # above every old id: the old free ones go first
            heapq.heappush(self._free, p)
        self._refcount.extend([0] * (num_pages - self.num_pages))
        if len(self.tags_np) < num_pages:
            self.tags_np = np.concatenate([self.tags_np, np.zeros(num_pages - len(self.tags_np), np.int64)])
            self.tags = torch.from_numpy(self.tags_np)
        self.num_pages = num_pages

    def num_free_below(self, limit: int) -> int:
        return sum(1 for p in self._free if p < limit)

    def allocate_below(self, n: int, limit: int) -> list[int]:
        """`allocate`, taking only free ids under `limit` (the lowest first)."""
        low = heapq.nsmallest(n, self._free)
        if len(low) < n or (low and low[-1] >= limit):
            raise OutOfPagesError(f"need {n} pages below {limit}, {self.num_free_below(limit)} free")
        taken = set(low)
        self._free = [p for p in self._free if p not in taken]
        heapq.heapify(self._free)
        for p in low:
            self._refcount[p] = 1
            self.tags_np[p] += 1
        return low

    def shrink(self, num_pages: int) -> None:
        """Hand out only ids under `num_pages` from now on (the KV tensors are about to shrink to
        match). Every id dropped must be free. Their tags are bumped, and kept for a later grow,
        so a stale record of a dropped page can never match again."""
        if num_pages >= self.num_pages:
            return
        held = [p for p in range(num_pages, self.num_pages) if self._refcount[p]]
        if held:
            raise ValueError(f"cannot drop pages {held[:8]}: still held")
        self._free = [p for p in self._free if p < num_pages]
        heapq.heapify(self._free)
        del self._refcount[num_pages:]
        self.tags_np[num_pages:self.num_pages] += 1
        self.num_pages = num_pages


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_MARGIN = 2.0  # scale = margin * first absmax / FP8_MAX: later tokens may run up to 2x larger


class KVCache:
    """The two per-token rows of every layer (K and V, or an MLA latent and rope key), addressed by
    flat slot index."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                 spec: StateSpec | None = None, window_layers: tuple[int, ...] = (), window_pages: int = 0):
        """window_layers: the paged layers of a windowed kind (spec.PagedWindowKV), whose rows live
        in their own pool of `window_pages` pages (addressed by window.WindowPages' tables, not by
        the request's page table); `k[layer]` / `v[layer]` are then per-layer views."""
        self.spec = spec or PagedKV(num_kv_heads, head_dim)
        (kh, kw), (vh, vw) = self.spec.rows
        self.quantized = dtype == FP8
        storage = torch.uint8 if self.quantized else dtype
        self.device = torch.device(device)
        self.window_layers = tuple(window_layers)
        self.windows = None   # window.WindowPages of the windowed layers (for_specs sets it)
        nf = num_layers - len(self.window_layers)
        self._k = torch.zeros((nf, num_pages * page_size, kh, kw), dtype=storage, device=self.device)
        self._v = torch.zeros((nf, num_pages * page_size, vh, vw), dtype=storage, device=self.device)
        nw = len(self.window_layers)
        self._wk = torch.zeros((nw, window_pages * page_size, kh, kw), dtype=storage, device=self.device)
        self._wv = torch.zeros((nw, window_pages * page_size, vh, vw), dtype=storage, device=self.device)
        self._views()
        self.dtype = dtype
        self.page_size = page_size
        self.num_pages = num_pages
        # [L, row heads] fp32 scales; 0 = layer not calibrated yet (fp8 only)
        self.k_scale = torch.zeros(num_layers, kh, device=self.device)
        self.v_scale = torch.zeros(num_layers, vh, device=self.device)
        self._layer_calibrated = [not self.quantized] * num_layers  # a Python flag: no tensor op per write
        # [L] int64 FP8 elements written beyond +-448 x scale (saturated: outliers the calibration
        # did not see); a device tensor, so counting never waits for the device
        self.clipped_per_layer = torch.zeros(num_layers, dtype=torch.int64, device=self.device)
        self.index_layer: dict[int, int] = {}  # paged layer -> its row in `index` (DSA full layers)
        self.index = torch.zeros((0, num_pages * page_size, 1, 0), dtype=dtype, device=self.device)

    @classmethod
    def for_spec(cls, spec: StateSpec, num_layers: int, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> "KVCache":
        return cls(num_layers, num_pages, page_size, 0, 0, dtype, device, spec=spec)

    @classmethod
    def for_specs(cls, specs: list[StateSpec], num_pages: int, page_size: int, dtype: torch.dtype,
                  device: str | torch.device = "cpu", window_pages: int | None = None) -> "KVCache":
        """One spec per paged layer. Kinds may mix where their first two rows agree (MLA layers with
        and without a DSA index key; windowed and full K/V layers); the layers with a third row
        (the index key) get one in `index`, the windowed ones (spec.PagedWindowKV) their own pool
        of `window_pages` pages (default `num_pages`: never fewer than the full layers hold)."""
        base = {spec.rows[:2] for spec in specs}
        if len(base) != 1:
            raise ValueError(f"paged layers of different row shapes cannot share a pool: {sorted(base)}")
        windowed = [i for i, s in enumerate(specs) if window_of(s) is not None]
        if windowed:   # sliding-window layers next to full ones: their own pool (window.py)
            return cls._with_windows(specs, windowed, num_pages, page_size, dtype, device, window_pages)
        (_, latent), (_, rope) = specs[0].rows[:2]
        spec = specs[0] if len(specs[0].rows) == 2 else PagedLatent(latent, rope)
        cache = cls(len(specs), num_pages, page_size, 0, 0, dtype, device, spec=spec)
        indexed = [i for i, s in enumerate(specs) if len(s.rows) > 2]
        if indexed:
            (h, width), = {specs[i].rows[2] for i in indexed}
            store = INDEX_FP8_DTYPE if cache.quantized else dtype
            cache.index = torch.zeros((len(indexed), num_pages * page_size, h, width), dtype=store, device=cache.device)
            cache.index_layer = {layer: j for j, layer in enumerate(indexed)}
        return cache

    def _views(self) -> None:
        """`k` / `v`: the stacked tensors, or with windowed layers one view per paged layer."""
        if not self.window_layers:
            self.k, self.v = self._k, self._v
            return
        win = {layer: j for j, layer in enumerate(self.window_layers)}
        full = iter(range(self._k.shape[0]))
        order = [("w", win[i]) if i in win else ("f", next(full)) for i in range(len(win) + self._k.shape[0])]
        self.k = [self._wk[j] if g == "w" else self._k[j] for g, j in order]
        self.v = [self._wv[j] if g == "w" else self._v[j] for g, j in order]

    @classmethod
    def _with_windows(cls, specs, windowed: list[int], num_pages: int, page_size: int, dtype: torch.dtype,
                      device, window_pages: int | None) -> "KVCache":
        from freetoken_py.kvcache.window import WindowPages

        windows = {window_of(specs[i]) for i in windowed}
        if len(windows) != 1:
            raise ValueError(f"windowed layers of different windows cannot share a pool: {sorted(windows)}")
        (kh, kw), _ = specs[0].rows
        n = num_pages if window_pages is None else window_pages
        cache = cls(len(specs), num_pages, page_size, kh, kw, dtype, device, spec=PagedKV(kh, kw),
                    window_layers=tuple(windowed), window_pages=n)
        cache.windows = WindowPages(windows.pop(), page_size, n)
        return cache

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors addressed by the page table (the windowed layers' are not)."""
        return (self._k, self._v, self.index)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's state takes across every layer, measured from the stored tensors
        (a windowed layer's while the token is in its window)."""
        return sum(t.shape[0] * math.prod(t.shape[2:]) * t.element_size() for t in (*self._tensors(), self._wk, self._wv))

    @property
    def num_window_pages(self) -> int:
        return self._wk.shape[1] // self.page_size

    def grow_window(self, num_pages: int) -> None:
        """The windowed layers' pool to `num_pages` pages (stored rows kept; the allocator follows)."""
        if num_pages <= self.num_window_pages:
            return
        size = num_pages * self.page_size
        grown = [torch.zeros((t.shape[0], size, *t.shape[2:]), dtype=t.dtype, device=self.device)
                 for t in (self._wk, self._wv)]
        old = self._wk.shape[1]
        for new, cur in zip(grown, (self._wk, self._wv)):
            new[:, :old].copy_(cur)
        self._wk, self._wv = grown
        self._views()
        if self.windows is not None:
            self.windows.grow(num_pages)

    def write_index(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """keys: [T, index_dim] (DSA index keys of the new tokens) into paged layer `layer`'s index rows."""
        self.index[self.index_layer[layer]].index_copy_(0, slots, keys[:, None].to(self.index.dtype))

    def read_index(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The index keys of `slots`: [ctx, index_dim] at their stored precision."""
        return self.index[self.index_layer[layer]].index_select(0, slots)[:, 0]

    def grow(self, num_pages: int) -> None:
        """Reallocate K and V for `num_pages` pages, keeping every stored token (slot ids do not
        change). Needs the new size free for a moment, on top of the old."""
        if num_pages <= self.num_pages:
            return
        size = num_pages * self.page_size
        # (all first: a failure leaves the cache as it was)
        grown = [torch.empty((t.shape[0], size, *t.shape[2:]), dtype=t.dtype, device=self.device)
                 for t in self._tensors()]
        old = self._k.shape[1]
        for new, cur in zip(grown, self._tensors()):
            new[:, :old].copy_(cur)
            new[:, old:].zero_()
        mirrored = self.num_window_pages >= self.num_pages   # (a planned, bounded pool keeps its size)
        (self._k, self._v, self.index), self.num_pages = grown, num_pages
        self._views()
        if mirrored:
            self.grow_window(num_pages)   # a windowed layer never holds more pages than the full ones

    def shrink(self, num_pages: int) -> None:
        """Reallocate K and V for the first `num_pages` pages (the allocator dropped the rest,
        free). Needs the new size free for a moment, on top of the old; an allocation failure
        leaves the cache as it was."""
        if num_pages >= self.num_pages:
            return
        n = num_pages * self.page_size
        k, v, index = (t[:, :n].clone() for t in self._tensors())
        self._k, self._v, self.index, self.num_pages = k, v, index, num_pages
        self._views()   # (the windowed layers' pool keeps its size: its pages are addressed apart)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages `src[i]` -> `dst[i]` in every layer addressed by page tables (K and V)."""
        if not src:
            return
        offs = torch.arange(self.page_size)
        s = (torch.tensor(src)[:, None] * self.page_size + offs).flatten().to(self.device)
        d = (torch.tensor(dst)[:, None] * self.page_size + offs).flatten().to(self.device)
        for t in self._tensors():
            for layer in range(t.shape[0]):      # one layer at a time: a small temporary
                t[layer, d] = t[layer, s]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return page_bytes(PagedKV(num_kv_heads, head_dim), num_layers, page_size, dtype)  # fp8: 1 byte a value

    @property
    def calibrated(self) -> bool:
        return all(self._layer_calibrated)

    @property
    def clipped(self) -> int:
        """FP8 elements (K and V) clipped to +-448 x scale since start-up (0 unless quantized)."""
        return int(self.clipped_per_layer.sum())

    def set_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Fix the FP8 scales ([L, row heads] each, > 0) before any write, e.g. from a --kv-scales
        file. In place: the fused decoder holds views of these tensors."""
        if not self.quantized:
            raise ValueError("scales are for an FP8 cache")
        for name, new, cur in (("k_scale", k_scale, self.k_scale), ("v_scale", v_scale, self.v_scale)):
            if tuple(new.shape) != tuple(cur.shape):
                raise ValueError(f"{name}: shape {tuple(new.shape)}, the cache has {tuple(cur.shape)} (layers, heads)")
            if not bool((new > 0).all()) or not bool(torch.isfinite(new).all()):
                raise ValueError(f"{name}: every scale must be a finite number > 0")
            cur.copy_(new)
        self._layer_calibrated = [True] * len(self._layer_calibrated)

    def recalibrate(self) -> None:
        """Forget the FP8 scales and clip counts: the next write to each layer calibrates it again.
        Only while no page holds FP8 values written with the old scales."""
        if self.quantized:
            self.k_scale.zero_()
            self.v_scale.zero_()
            self.clipped_per_layer.zero_()
            self._layer_calibrated = [False] * len(self._layer_calibrated)

    def scales_fingerprint(self) -> tuple | None:
        """What the stored bytes mean: part of the prefix cache's namespace. None until calibrated."""
        if not self.quantized:
            return (str(self.dtype),)
        if not self.calibrated:
            return None
        return (str(self.dtype), hash(self.k_scale.cpu().numpy().tobytes()), hash(self.v_scale.cpu().numpy().tobytes()))

    def slots(self, page_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices of token positions [start, end) of a request."""
        pos = torch.arange(start, end)
        pages = torch.tensor(page_table, dtype=torch.long)[pos // self.page_size]
        return pages * self.page_size + pos % self.page_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, *spec.rows] in the compute dtype (paged K/V: [T, Hkv, hd] each)."""
        if not self.quantized:
            self.k[layer].index_copy_(0, slots, k.to(self._k.dtype))
            self.v[layer].index_copy_(0, slots, v.to(self._v.dtype))
            return
        if not self._layer_calibrated[layer]:  # first write to this layer: calibrate once, then fixed
            self.k_scale[layer] = _calibrate(k)
            self.v_scale[layer] = _calibrate(v)
            self._layer_calibrated[layer] = True
        for dst, x, scale in ((self.k, k, self.k_scale[layer]), (self.v, v, self.v_scale[layer])):
            q, clipped = _quantize(x, scale)
            dst[layer].index_copy_(0, slots, q)
            self.clipped_per_layer[layer] += clipped

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two rows of `slots`: [ctx, *spec.rows]; fp8 is dequantised to fp32."""
        k, v = self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)
        if not self.quantized:
            return k, v
        return _dequantize(k, self.k_scale[layer]), _dequantize(v, self.v_scale[layer])


def _calibrate(x: torch.Tensor) -> torch.Tensor:
    """x: [T, Hkv, hd] -> [Hkv] scale (absmax per head, with margin; never 0)."""
    absmax = x.detach().float().abs().amax(dim=(0, 2))  # [Hkv]
    return (absmax * FP8_MARGIN / FP8_MAX).clamp_min(1e-6)


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, Hkv, hd]; scale: [Hkv] -> uint8 e4m3 bit patterns (saturating), elements saturated."""
    y = x.float() / scale[None, :, None]
    clipped = (y.abs() > FP8_MAX).sum()      # 0-d int64 on x's device: the saturated elements
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8), clipped


def _dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.view(FP8).float() * scale[None, :, None]  # [ctx, Hkv, hd]
