"""Framework-neutral Triton kernels and their launch plans. Imports triton and numpy only.

Each family's tunable settings are one config dataclass, given to its plan functions as ``config=`` or,
for calls through the public ops (benchmarks, tests), set for a block with :func:`configure`.
"""
from ._config import configure
from ._loader import HostArray, get_kernel
from ._plan import INTERPRETER, Launch, Plan, Spec, Target

__all__ = ["HostArray", "INTERPRETER", "Launch", "Plan", "Spec", "Target", "configure", "get_kernel"]
