"""The front door: the names a user needs come from ``packkit`` itself, lazily.

``import packkit`` imports no packkit module and none of torch, datasets, transformers, pandas or pyarrow
(the ``packkit`` command imports the package first: its cold start must not grow); every name of
``packkit.__all__`` resolves, to the very object its home module holds; the home paths keep working.
Before, ``packkit`` held ``__version__`` only: the README's 14 modules were 14 import lines to learn.
"""

import importlib
import json
import pkgutil
import subprocess
import sys

import pytest

import packkit

HEAVY = ("torch", "datasets", "transformers", "pandas", "pyarrow")


def _fresh(code: str) -> dict:
    """Runs ``code`` in a new interpreter after ``import packkit``; its last line printed ``out`` as JSON."""
    script = "import json, sys\nimport packkit\n" + code + "\nprint(json.dumps(out))"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def test_import_packkit_imports_nothing_heavy_nor_any_packkit_module():
    out = _fresh("out = {'heavy': [m for m in %r if m in sys.modules],\n"
                 "       'packkit': sorted(m for m in sys.modules if m.startswith('packkit.')),\n"
                 "       'all': len(packkit.__all__), 'dir': len(dir(packkit))}" % (HEAVY,))
    assert out["heavy"] == [], f"import packkit imported {out['heavy']}"
    assert out["packkit"] == [], f"import packkit imported {out['packkit']}: the front door is not lazy"
    assert out["all"] > 30 and out["dir"] >= out["all"]


@pytest.mark.slow  # a subprocess that imports what planning needs
def test_a_light_name_imports_only_its_home():
    """``packkit.pack`` and the figures (``plan_budget``, ``measure_waste``) are numpy: asking for them through
    the front door imports no torch, as their home modules do not (tests/test_layering.py)."""
    out = _fresh("packkit.pack, packkit.plan_budget, packkit.measure_waste, packkit.Plan\n"
                 "out = [m for m in %r if m in sys.modules]" % (HEAVY[:3],))
    assert out == []


@pytest.mark.parametrize("name", [n for n in packkit.__all__ if n != "__version__"])
def test_every_name_is_its_home_modules_object(name):
    home = importlib.import_module(f"packkit.{packkit._HOME[name]}")
    assert getattr(packkit, name) is getattr(home, name)
    assert name in dir(packkit)
    # ``from packkit import *`` brings it too
    space = {}
    exec("from packkit import *", space)
    assert space[name] is getattr(home, name)


def test_no_front_name_shadows_a_submodule():
    """Importing ``packkit.X`` sets the package's attribute ``X`` to the module: a front name equal to a
    submodule's would change under the user's feet."""
    submodules = {m.name for m in pkgutil.iter_modules(packkit.__path__)}
    assert submodules >= {"collate", "binpack", "cli"}, "the walk itself is broken"
    assert not submodules & set(packkit.__all__)


def test_home_paths_and_submodules_still_import():
    from packkit import cli  # a submodule, not a front name: __getattr__'s AttributeError lets import find it
    from packkit.collate import PaddingFreeCollator

    assert cli.__name__ == "packkit.cli"
    assert packkit.PaddingFreeCollator is PaddingFreeCollator
    assert packkit.__version__


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="'no_such_name'"):
        packkit.no_such_name  # noqa: B018
    with pytest.raises(ImportError, match="no_such_name"):
        from packkit import no_such_name  # noqa: F401
