"""flashbridge: one set of Triton kernels for attention and its neighbours, for PyTorch and JAX.

The front-ends are subpackages imported on demand, each with the extra that installs its framework:
``flashbridge.torch_api`` (``pip install "flashbridge[torch]"``) and ``flashbridge.jax_api``
(``pip install "flashbridge[jax]"``). ``python -m flashbridge check`` runs every op of every installed
framework against the float64 references in ``flashbridge.reference``. ``flashbridge.tiles`` explains every
kernel's tiles for any GPU; :func:`warmup` compiles the kernels a model will use ahead of time.
"""

# The one place the version is written: pyproject.toml reads it from here (setuptools' ``attr:``).
__version__ = "0.1.0"



def warmup(ops=("attention", "decode", "norms", "cross_entropy"), head_dims=(64, 128), dtypes=("bfloat16",), **kw):
    """Compile the kernels of ``ops`` for ``head_dims`` and ``dtypes`` on the current GPU before the first call
    (see :func:`flashbridge.tiles.warmup.warmup`); returns the number of launches warmed, 0 on a CPU."""
    from .tiles.warmup import warmup as _warmup

    return _warmup(ops, head_dims, dtypes, **kw)


__all__ = ["__version__", "warmup"]
