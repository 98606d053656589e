"""The messager with a planted fault, for the tests: `python -m pdhal_vllm.testing.messager
--exit-after-layers N [the messager's options]` exits (status 3) before its service is
given layer submit N + 1, once the N it was given landed, so the decode cache holds
exactly those however the layer signals were batched. It traces crc32s as
pdhal_vllm.testing.crc's does."""

from __future__ import annotations

import argparse
import os
import sys
import time

from pdhal_vllm import messager
from pdhal_vllm.testing.crc import CrcMessager


class ExitingMessager(CrcMessager):
    exit_after = 0
    given = 0  # layer submits the service was given

    def give_layer(self, service, layer: int, ready, signal_ns, step) -> None:
        if self.given >= self.exit_after:
            metrics = service.streamer.metrics
            deadline = time.monotonic() + 10.0
            while metrics.layers_landed < self.exit_after and time.monotonic() < deadline:
                time.sleep(0.001)  # once: the copies of those N run meanwhile
            self.trace("fault", what="exit", layers=metrics.layers_landed)
            os._exit(3)
        super().give_layer(service, layer, ready, signal_ns, step)
        self.given += 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--exit-after-layers", type=int, required=True)
    known, rest = parser.parse_known_args(argv)
    ExitingMessager.exit_after = known.exit_after_layers
    return messager.main(rest, ExitingMessager)


if __name__ == "__main__":
    sys.exit(main())
