"""Hardware profile: what this machine is and how fast it moves bytes, measured, not assumed.

    from freetoken_py.hw import get_profile
    profile = get_profile()                        # cached + quick revalidation, or measured
    profile.figure("dram_read_all_cores").gbps     # GB/s (10^9 B/s), median of the samples

Figure names are listed in `freetoken_py.hw.registry`. Importing this package is light: torch and
numba load only when something is measured.
"""
from freetoken_py.hw.profile import PROFILE_VERSION, Figure, HardwareProfile
from freetoken_py.hw.runner import get_profile

__all__ = ["PROFILE_VERSION", "Figure", "HardwareProfile", "get_profile"]
