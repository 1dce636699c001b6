"""Weight quantization references: pack / dequant in torch (numpy in, numpy out).

These are the formats the CPU kernels execute (freetoken_py.kernels) and the references their
tests compare against:

- int8: symmetric per output channel, ``q = round(w / s)``, ``s = max|w_row| / 127``.
- int4: symmetric per group of ``group_size`` input columns, ``q in [-8, 7]`` stored as ``q + 8``,
  two per byte, low nibble = even column.
"""
from freetoken_py.quant.int4 import dequantize_int4, quantize_int4
from freetoken_py.quant.int8 import dequantize_int8, quantize_int8

__all__ = ["quantize_int8", "dequantize_int8", "quantize_int4", "dequantize_int4"]
