"""Weight quantization references: pack / dequant in torch (numpy in, numpy out).

These are the formats the CPU kernels execute (freetoken_py.kernels) and the references their
tests compare against:

- int8: symmetric per output channel, ``q = round(w / s)``, ``s = max|w_row| / 127``.
- int4: symmetric per group of ``group_size`` input columns, ``q in [-8, 7]`` stored as ``q + 8``,
  two per byte, low nibble = even column.
- q8 activations: int8 per block of 32 elements, ``s = max|x_block| / 127`` (``q8act``): what the
  int4 and int8 kernels multiply the weights with on AVX2 CPUs (``roundtrip_act_q8``: x as they see it).
"""
from freetoken_py.quant.int4 import dequantize_int4, quantize_int4
from freetoken_py.quant.int8 import dequantize_int8, quantize_int8
from freetoken_py.quant.q8act import dequantize_act_q8, quantize_act_q8, roundtrip_act_q8

__all__ = ["quantize_int8", "dequantize_int8", "quantize_int4", "dequantize_int4", "quantize_act_q8", "dequantize_act_q8",
           "roundtrip_act_q8"]
