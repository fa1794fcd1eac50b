"""Framework-neutral Triton kernels and their launch plans. Imports triton and numpy only."""
from ._config import configure
from ._loader import HostArray, get_kernel
from ._plan import INTERPRETER, Launch, Plan, Spec, Target

__all__ = ["HostArray", "INTERPRETER", "Launch", "Plan", "Spec", "Target", "configure", "get_kernel"]
