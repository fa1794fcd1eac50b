"""flashbridge: one set of Triton kernels for attention and its neighbours, for PyTorch and JAX.

The front-ends are subpackages imported on demand, each with the extra that installs its framework:
``flashbridge.torch_api`` (``pip install "flashbridge[torch]"``) and ``flashbridge.jax_api``
(``pip install "flashbridge[jax]"``). ``python -m flashbridge check`` runs every op of every installed
framework against the float64 references in ``flashbridge.reference``.
"""

# The one place the version is written: pyproject.toml reads it from here (setuptools' ``attr:``).
__version__ = "0.1.0"

__all__ = ["__version__"]
