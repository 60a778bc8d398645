"""twin.abi: the one ABI description shared by golden, the simulator and the hardware backend.

Presets, topology and serving limits, the six programs' positional arguments, the seven cache
families and the drafter pools, startup capacity and the per-rank HBM account, ring heaps.  It imports nothing of ours but
itself (docs/architecture.md, "Import rules"), and only numpy from outside.
"""
from . import constants
from .caches import FAMILY_NAMES, CacheFamily, DrafterPools, cache_families, page_alignment, size_families
from .account import HbmAccount, hbm_account
from .budget import MEASURED_BOOT, Boot, Measurement, budget_interval
from .capacity import admit_slots, allocate_with_retry, bytes_per_slot, family_sizing, scratch_bytes, slots_from_budget
from .hbm import Line, itemized_lines
from .errors import AbiError, CapacityError, ConfigError
from .presets import FLASH, PRESETS, SMALL, TINY, ModelConfig, get_preset
from .programs import PROGRAMS, Arg, BoundArg, Program, bind, get_program, programs_for_k, symbols
from .ringheap import DEFAULT_PROFILES, parse_ring_heap, resolve_profiles
from .topology import Deployment, ServingLimits, Topology, deployment

__all__ = [
    "constants", "FAMILY_NAMES", "CacheFamily", "DrafterPools", "cache_families", "page_alignment",
    "size_families", "HbmAccount", "admit_slots", "allocate_with_retry", "bytes_per_slot", "family_sizing",
    "hbm_account", "scratch_bytes", "slots_from_budget", "MEASURED_BOOT", "Boot", "Measurement",
    "budget_interval", "Line", "itemized_lines", "AbiError", "CapacityError", "ConfigError", "FLASH",
    "PRESETS", "SMALL", "TINY", "ModelConfig", "get_preset", "PROGRAMS", "Arg", "BoundArg", "Program", "bind",
    "get_program", "programs_for_k", "symbols", "DEFAULT_PROFILES", "parse_ring_heap", "resolve_profiles",
    "Deployment", "ServingLimits", "Topology", "deployment",
]
