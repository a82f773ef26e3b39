"""CI: packkit against the lowest release of each framework range it declares (issue 29). The CI venv holds the
newest transformers, TRL and accelerate; this runs the tests that touch their private surface again with each
framework at the bottom of its ``SUPPORTED`` (``packkit.integrations.transformers`` / ``.trl`` / ``.accelerate``), so
both ends of a range are tested.

    .venv/bin/python .ci/bounds.py                         # each framework at its range's lowest release (or FLOOR)
    .venv/bin/python .ci/bounds.py transformers==5.17.0    # that release instead (the range's bottom, or a probe)

The lowest release is the lowest final one that ``pip index versions`` lists for this Python inside
``[first, past)``, raised to :data:`FLOOR` where that names a higher one (said in the output). pip resolves those
pins against the CI venv (``--dry-run``: only the distributions that must change, tokenizers and huggingface_hub with
transformers), they are installed with ``--no-deps`` into a temporary folder put first on ``PYTHONPATH``, and the venv
is left as it is. It fails (exit 1) when that folder does not hold what was asked, when it breaks a requirement
``pip check`` found met without it, when a selected test fails, when a framework is skipped as missing, or when no
test runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

#: The framework -> the module declaring its ``SUPPORTED``, and the extras pip resolves it with: ``kernels`` lies in
#: the CI venv (transformers 5.25 requires it) and transformers imports it whenever it is installed, so the
#: kernels the lower transformers accepts must come with it (transformers 5.0 fails to import with kernels 0.19).
FRAMEWORKS = {"transformers": ("packkit.integrations.transformers", "[hub-kernels]"),
              "trl": ("packkit.integrations.trl", ""), "accelerate": ("packkit.integrations.accelerate", "")}

#: Releases the declared range holds that the tests below fail on, so CI tests the lowest that passes meanwhile
#: (delete an entry once the range no longer reaches below it; the output says when). None today: transformers
#: < 5.17 (a resumed Trainer replayed epoch 0's batches) is out of its range.
FLOOR: dict = {}

#: The tests that exercise the integrations: the hooks themselves, and the real trainers through them.
TESTS = (
    "tests/test_integrations.py",            # every hook's signature, the attention call, the chat compiler
    "tests/test_preference.py",              # DPOTrainer's private _compute_loss (DPOLossHook)
    "tests/test_loss_weighting_trainer.py",  # Trainer's step count and kept columns (StepCountHook)
    "tests/test_trainers.py",                # SFTTrainer and Trainer with packkit's collators
    "tests/test_trainer_dropin.py",          # a real Trainer's losses against the same steps by hand
    "tests/test_batch_dict.py",              # Trainer._prepare_input's rebuild of a batch (prepare_input_caller)
    "tests/test_chat_trl.py",                # TRL's training templates and SFTTrainer's assistant mask
    "tests/test_chat_masks.py",              # transformers' chat-template steps (render_chat)
    "tests/test_resume_trainer.py",          # Trainer's resume through packkit's batch sampler
    "tests/test_resume_loaders.py",          # resume through accelerate's loader and batch-sampler wrappers
)


def pip(*args: str, env: dict | None = None, capture: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], env=env, text=True, check=not capture,
                          capture_output=capture)


def supported(module: str) -> tuple:
    """The ``[first, past)`` range ``module`` declares, read from this checkout."""
    sys.path.insert(0, str(ROOT))
    try:
        return __import__(module, fromlist=["SUPPORTED"]).SUPPORTED
    finally:
        sys.path.remove(str(ROOT))


def lowest(name: str, first: tuple, past: tuple) -> str:
    """``lowest("trl", (1, 16), (1, 17)) -> "1.16.0"``: the lowest final release pip can install here in the range."""
    out = pip("index", "versions", "--json", name, capture=True)
    if out.returncode:
        sys.exit(f"bounds: pip index versions {name} failed: {out.stderr.strip()[-400:]}")
    inside = [v for v in map(Version, json.loads(out.stdout)["versions"])
              if not v.is_prerelease and first <= v.release[:2] < past]
    if not inside:
        sys.exit(f"bounds: no {name} release in [{first}, {past}) that pip can install for this Python")
    return str(min(inside))


def pins(argv: list) -> dict:
    """``{name: version}`` to test: each framework's lowest release, or the version named on the command line."""
    asked = dict(a.split("==", 1) for a in argv)
    unknown = set(asked) - set(FRAMEWORKS)
    if unknown or not all(re.fullmatch(r"[\w.]+", v) for v in asked.values()):
        sys.exit(f"bounds: pass NAME==VERSION with NAME in {sorted(FRAMEWORKS)}; got {argv}")
    chosen = {}
    for name, (module, _) in FRAMEWORKS.items():
        first, past = supported(module)
        low = lowest(name, first, past)
        floor = FLOOR.get(name, low)
        chosen[name] = asked.get(name, max(low, floor, key=Version))
        span = f"{name} >={'.'.join(map(str, first))},<{'.'.join(map(str, past))} (lowest release {low})"
        if Version(floor) <= Version(low) and name in FLOOR:
            print(f"bounds: note: FLOOR[{name!r}] = {floor} is at or below the range's lowest now: delete it")
        if chosen[name] == low:
            print(f"bounds: {span}: testing {low}")
        elif not first <= Version(chosen[name]).release[:2] < past:
            print(f"bounds: {span}: testing {chosen[name]}, OUTSIDE the declared range (a probe: expect failures)")
        elif chosen[name] == floor:
            print(f"bounds: {span}: testing {floor}, NOT the declared lowest: FLOOR in .ci/bounds.py says why")
        else:
            print(f"bounds: {span}: testing {chosen[name]}, as asked")
    return chosen


def overlay(chosen: dict, folder: Path) -> dict:
    """Install into ``folder`` what must change in the CI venv for ``chosen``; returns ``{name: version}`` of it."""
    report = folder / "report.json"
    pip("install", "--dry-run", "--quiet", "--report", str(report),
        *(f"{n}{FRAMEWORKS[n][1]}=={v}" for n, v in chosen.items()))
    change = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    if change:
        pip("install", "--quiet", "--no-deps", "--target", str(folder / "site"),
            *(f"{n}=={v}" for n, v in change.items()))
    return change


def check(chosen: dict, env: dict) -> None:
    """Stop unless the overlay is what Python imports, and it breaks no requirement met without it."""
    probe = ("import importlib, importlib.metadata as md, json, sys\n"
             "names = sys.argv[1:]\n"
             "print(json.dumps({n: [md.version(n), importlib.import_module(n).__version__] for n in names}))")
    out = subprocess.run([sys.executable, "-c", probe, *chosen], env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"bounds: importing {sorted(chosen)} over the overlay failed:\n{out.stderr[-3000:]}")
    seen = json.loads(out.stdout)
    wrong = {n: seen[n] for n, v in chosen.items() if seen[n] != [v, v]}
    if wrong:
        sys.exit(f"bounds: Python imports {wrong}, not {chosen}: the overlay is not first on sys.path")

    def unmet(env=None):  # "A 1.0 has requirement B<5, but you have B 5.0." -> "A 1.0 has requirement B<5"
        return {line.split(", but you have")[0] for line in pip("check", env=env, capture=True).stdout.splitlines()}

    broken = sorted(unmet(env) - unmet())
    if broken:
        sys.exit("bounds: the overlay breaks requirements met without it:\n  " + "\n  ".join(broken))


def run_tests(env: dict, junit: Path) -> int:
    """pytest over :data:`TESTS` (two workers, each file whole on one; skips listed); 1 on a failure, on no test
    run, or on a test skipped by ``pytest.importorskip``."""
    rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                         "loadfile", "-rs", f"--junitxml={junit}", *TESTS], cwd=ROOT, env=env).returncode
    if rc:
        print(f"bounds: pytest exited {rc}" + (" (no tests collected)" if rc == 5 else ""))
        return 1
    skips = [(f"{case.get('classname')}::{case.get('name')}", mark.get("message", ""))
             for case in ET.parse(junit).iter("testcase") for mark in case.findall("skipped")]
    missing = [test for test, why in skips if why.startswith("could not import")]  # pytest.importorskip's words
    if missing:
        print(f"bounds: {len(missing)} test(s) skipped as if a framework were missing, which would hide a break: "
              f"{missing}")
        return 1
    return 0


def main(argv: list) -> int:
    start = time.perf_counter()
    chosen = pins(argv)
    folder = Path(tempfile.mkdtemp(prefix="packkit-bounds-"))
    try:
        change = overlay(chosen, folder)
        print(f"bounds: over the CI venv: {' '.join(f'{n}=={v}' for n, v in change.items()) or 'nothing'} "
              f"({time.perf_counter() - start:.0f} s)")
        path = os.pathsep.join(filter(None, [str(folder / "site"), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "HYPOTHESIS_PROFILE": "ci", "TRITON_INTERPRET": "1"}
        check(chosen, env)
        rc = run_tests(env, folder / "junit.xml")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    tested = " ".join(f"{n}=={v}" for n, v in chosen.items())
    print(f"bounds: {tested}: {'FAILED' if rc else 'passed'} in {time.perf_counter() - start:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
