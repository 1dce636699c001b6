"""freetoken: an edge-native Mixture-of-Experts inference runtime.

Importing this package is cheap: heavy modules (torch, numba) load only inside
the entry points that need them.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
