"""The dependency arrows: the runtime knows the model only through the artifact."""

from __future__ import annotations

import subprocess
import sys


def _imported_mg_modules(module: str) -> set[str]:
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('mg.'))))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_runtime_never_imports_export():
    for module in ("mg.runtime", "mg.runtime.cli"):
        loaded = _imported_mg_modules(module)
        assert not any(m == "mg.export" or m.startswith("mg.export.") for m in loaded), (module, loaded)


def test_manifests_import_nothing_of_ours():
    loaded = _imported_mg_modules("mg.manifests")
    assert all(m.startswith("mg.manifests") for m in loaded), loaded
