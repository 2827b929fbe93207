"""Where executorch 1.2's serializers find their `flatc` binary (1.5 needs none).

executorch 1.2 writes and reads flatbuffers (programs, FlatTensor data files) by running `flatc`, which it
looks for in `$FLATC_EXECUTABLE`, then on PATH. Its wheel ships the binary inside the package, but an
install into a plain folder (`pip install --target`) puts no `flatc` on PATH. Shared by the exporter and the
runtime; imports nothing of ours.
"""

from __future__ import annotations

import os
from pathlib import Path


def ensure_flatc() -> None:
    """Point `$FLATC_EXECUTABLE` at the `flatc` inside the executorch package, once, unless it is set."""
    if "FLATC_EXECUTABLE" in os.environ:
        return
    import executorch

    flatc = Path(list(executorch.__path__)[0]) / "data" / "bin" / "flatc"  # a namespace package: no __file__
    if flatc.is_file():
        if not os.access(flatc, os.X_OK):
            flatc.chmod(flatc.stat().st_mode | 0o111)
        os.environ["FLATC_EXECUTABLE"] = str(flatc)
