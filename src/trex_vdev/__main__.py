"""``python -m trex_vdev [trex arguments]``: the trex CLI in a process with "vdev" registered.

``TREX_DEVICE`` defaults to "vdev" here, so ``python -m trex_vdev smoke`` runs trex's smoke test on
the virtual device (``--device`` still overrides it).
"""

from __future__ import annotations

import os
import sys

import trex_vdev  # noqa: F401 - registers the device


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TREX_DEVICE", trex_vdev.DEVICE_TYPE)
    from trex.cli import main as trex_main

    return trex_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
