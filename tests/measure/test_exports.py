"""``autoprec.measure``'s lazy exports: a name shared by a function and its submodule
(``training_step``) stays the function whichever export is imported first."""

from __future__ import annotations

import subprocess
import sys


def test_training_step_is_the_function_after_a_sibling_export_loaded_its_module() -> None:
    code = ("from autoprec.measure import step_peak_bytes\n"
            "from autoprec.measure import training_step\n"
            "import autoprec.measure as m\n"
            "assert callable(training_step) and callable(m.training_step), training_step\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr[-500:]


def test_no_submodule_is_named_like_an_export() -> None:
    """Importing a submodule sets the package's attribute of its name; an export of the
    same name would then resolve to the module instead of the function."""
    import pkgutil

    import autoprec.measure as measure

    submodules = {m.name for m in pkgutil.iter_modules(measure.__path__)}
    assert not submodules & set(measure.__all__)
