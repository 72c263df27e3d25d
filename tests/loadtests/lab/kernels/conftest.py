"""The kernel benchmarks run their kernels as the kernel tests do: in Triton's interpreter
without a GPU (the kernels' conftest switches it on when imported)."""

from tests.kernels.conftest import tiles  # noqa: F401
