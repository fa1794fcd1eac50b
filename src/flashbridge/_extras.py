"""What each pip extra installs, and the error that names the extra when its package is missing."""
from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, needed_by: str) -> ModuleType:
    """Import ``module``; when it is not installed, a ModuleNotFoundError saying which extra installs it
    (a missing dependency *of* that module is reported as it is)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module.partition(".")[0]:
            raise
        raise ModuleNotFoundError(f"{needed_by} needs {module}, which is not installed: "
                                  f'pip install "flashbridge[{extra}]"', name=module) from None
