"""Entry point module. Keep it cheap: importing it must not load your runtime."""

from pdhal.plugin import hookimpl


@hookimpl
def pdhal_backend():
    from pdhal_example._backend import ExampleBackend

    return ExampleBackend()
