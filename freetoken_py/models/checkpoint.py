"""Reading a Hugging Face checkpoint directory: config, safetensors headers, tensors via mmap.

Only JSON and safetensors are ever read (no pickle). Every problem is reported as a one-line
ModelLoadError naming the file and, where there is one, the tensor.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from freetoken_py.errors import ModelLoadError

SUPPORTED_DTYPES = {"F32": 4, "BF16": 2, "F16": 2}
_ALL_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    # a part of the stored tensor `name`: (index along dim 0, row start, row end) of its dim 1
    # (a fused [E, 2I, D] expert stack read as per-expert gate / up / down tensors); None = all
    part: tuple[int, int, int] | None = None
    # with `part`: every `step`-th row of start:end (an interleaved stack, gpt-oss's gate / up),
    # taken after swapping the expert's two dims when `transposed` (an input-major [E, in, out] stack)
    step: int = 1
    transposed: bool = False

    def sub(self, index: int, start: int | None = None, end: int | None = None) -> "TensorInfo":
        """The view `stored[index, start:end]` of a 3-D tensor, under the same stored name."""
        start, end = start or 0, self.shape[1] if end is None else end
        shape = (end - start, *self.shape[2:])
        per = self.nbytes // (self.shape[0] * self.shape[1])
        return TensorInfo(self.name, self.file, self.dtype, shape, per * (end - start), (index, start, end))


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object at the top level")
    return data


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one file's header and check every tensor's byte range lies inside the file."""
    try:
        file_bytes = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise ModelLoadError(f"{path}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(_MAX_HEADER_BYTES, file_bytes - 8):
                raise ModelLoadError(f"{path}: truncated or corrupt safetensors header "
                                     f"(header says {header_len} bytes, file has {file_bytes})")
            header = json.loads(f.read(header_len))
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelLoadError(f"{path}: corrupt safetensors header (not JSON)") from None
    data_bytes = file_bytes - 8 - header_len
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor_info(path, name, meta, data_bytes)
    return out


def _tensor_info(path: Path, name: str, meta: dict, data_bytes: int) -> TensorInfo:
    try:
        dtype, shape, (start, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise ModelLoadError(f"{path}: tensor '{name}': malformed header entry") from None
    if dtype not in _ALL_DTYPE_BYTES:
        raise ModelLoadError(f"{path}: tensor '{name}': unknown dtype {dtype}")
    numel = 1
    for d in shape:
        numel *= d
    if end - start != numel * _ALL_DTYPE_BYTES[dtype]:
        raise ModelLoadError(f"{path}: tensor '{name}': byte range does not match shape {list(shape)}")
    if end > data_bytes:
        raise ModelLoadError(f"{path}: truncated file: tensor '{name}' needs bytes up to {end} "
                             f"but only {data_bytes} are present")
    return TensorInfo(name, path, dtype, shape, end - start)


def list_checkpoint_tensors(model_dir: Path) -> dict[str, TensorInfo]:
    """All tensors of a single-file or sharded checkpoint, keyed by name."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path}: missing 'weight_map'")
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files (only safetensors checkpoints are loaded; "
                             "pickle .bin files are refused for safety)")
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        if not path.exists():
            raise ModelLoadError(f"{index_path}: lists shard {path.name}, which does not exist")
        for name, info in read_safetensors_header(path).items():
            if name in tensors:
                raise ModelLoadError(f"{path}: tensor '{name}' also appears in {tensors[name].file.name}")
            tensors[name] = info
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in tensors:
                raise ModelLoadError(f"{model_dir / fname}: tensor '{name}' is listed in the index but missing")
    return tensors


class TensorReader:
    """Reads tensors through safetensors' mmap, one file handle per shard, opened lazily."""

    def __init__(self, tensors: dict[str, TensorInfo]):
        self._tensors = tensors
        self._handles: dict[Path, object] = {}

    def get(self, name: str):
        from safetensors import safe_open

        info = self._tensors[name]
        handle = self._handles.get(info.file)
        if handle is None:
            try:
                handle = safe_open(str(info.file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise ModelLoadError(f"{info.file}: cannot open safetensors file ({exc})") from None
            self._handles[info.file] = handle
        if info.part is not None:  # one expert's rows of a fused stack
            e, a, b = info.part
            if info.step == 1 and not info.transposed:
                return handle.get_slice(info.name)[e:e + 1, a:b][0]
            t = handle.get_slice(info.name)[e:e + 1][0]
            return (t.transpose(0, 1) if info.transposed else t)[a:b:info.step].contiguous()
        return handle.get_tensor(info.name)  # the stored name (a model file may rename, loader._model_names)

    def close(self) -> None:
        self._handles.clear()


class LogicalReader:
    """Reads a checkpoint's logical tensors (the model file's names) through its format decoder:
    `get` gives the float tensor (dequantised where the checkpoint stores it packed), `packed` the
    `formats.Packed` weight in its execution format (None where stored plain)."""

    def __init__(self, stored: dict[str, TensorInfo], decoder):
        self._raw = TensorReader(stored)
        self.decoder = decoder

    def get(self, name: str):
        return self.decoder.get(self._raw, name)

    def packed(self, name: str):
        return self.decoder.packed(self._raw, name)

    def close(self) -> None:
        self._raw.close()
