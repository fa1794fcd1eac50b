"""flashbridge: one set of Triton kernels for attention and its neighbours, for PyTorch and JAX.

Front-ends are imported on demand: ``flashbridge.torch_api`` needs torch, ``flashbridge.jax_api`` needs jax.
"""
__version__ = "0.1.0"
