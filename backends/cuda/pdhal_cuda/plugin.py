"""Entry point module: cheap to import, loads no runtime."""

from pdhal.plugin import hookimpl


@hookimpl
def pdhal_backend():
    from pdhal_cuda._backend import CudaBackend

    return CudaBackend()
