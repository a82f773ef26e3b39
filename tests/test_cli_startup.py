"""The commands start light: ``packkit --help``, ``waste`` on the bundled sample, ``plan``, ``pack`` of JSON
lines to ``.arrow`` and ``.parquet`` and ``tokenize`` of text import none of torch (2 s), datasets (1 s,
with pandas) and transformers; pandas only where pyarrow reads data (pyarrow 26 imports it on its first
``pa.array`` or ``to_numpy``, not packkit).

Before the fix every command imported torch through ``packkit.cp`` (for its ``LAYOUTS``), ``waste
--preference`` through ``packkit.preference`` too, and ``pack`` imported datasets whatever its input:
``packkit waste`` took 2.9 s of CPU, all but 0.5 s of it imports.

``sys.modules`` is the point, so the commands run in one fresh interpreter; the same commands run in this
process (torch and datasets loaded) print the same lines and write the same bytes.
"""

import argparse
import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import datasets  # noqa: F401 - this process runs the same commands with the heavy packages loaded
import pytest
import torch  # noqa: F401

from packkit import cli
from packkit.cli import plan as plan_command

pytestmark = pytest.mark.slow  # a subprocess

HEAVY = ("torch", "datasets", "pandas", "transformers")

#: ``(argv, reads data with pyarrow)``, in this order: what a command imported stays imported for the next
#: ones, so those that read no file come first. OUT paths are relative to the folder the commands run in.
COMMANDS = [
    (["--help"], False),
    (["waste"], False),
    (["waste", "--cp", "4", "--json"], False),
    (["plan", "--synthetic", "500", "--cp", "2"], False),
    (["pack", "in.jsonl", "out.arrow", "--window", "64", "-q"], True),
    (["pack", "in.jsonl", "out.parquet", "--window", "64", "--cp", "2", "--cp-layout", "zigzag"], True),
    (["tokenize", "text.jsonl", "tok.arrow", "--tokenizer", "bytes"], True),
    (["waste", "pairs.jsonl", "--preference", "--window", "64"], True),
]

#: Runs in a fresh interpreter: every command through cli.main, what it printed and what it had imported.
CHILD = """
import contextlib, io, json, sys
from packkit import cli
out = []
for argv in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(argv)
    out.append({"code": code, "stdout": buf.getvalue(),
                "loaded": [m for m in %r + ("pyarrow",) if m in sys.modules]})
print(json.dumps(out))
""" % (HEAVY,)


def _inputs(folder):
    rows = [{"input_ids": list(range(1, 2 + (7 * i) % 50))} for i in range(40)]
    (folder / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = [{"prompt_ids": [1] * (2 + i % 7), "chosen_ids": [2] * (1 + i % 5), "rejected_ids": [3] * (1 + i % 3)}
             for i in range(20)]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (folder / "text.jsonl").write_text("".join(json.dumps({"text": f"example {i} " * i}) + "\n" for i in range(1, 9)))


def _run_here(folder, capsys, monkeypatch) -> list:
    monkeypatch.chdir(folder)
    capsys.readouterr()
    out = []
    for argv, _ in COMMANDS:
        code = cli.main(argv)
        out.append({"code": code, "stdout": capsys.readouterr().out})
    return out


def test_commands_import_no_torch_datasets_transformers(tmp_path, capsys, monkeypatch):
    fresh, here = tmp_path / "fresh", tmp_path / "here"
    for folder in (fresh, here):
        folder.mkdir()
        _inputs(folder)
    argvs = json.dumps([argv for argv, _ in COMMANDS])
    proc = subprocess.run([sys.executable, "-c", CHILD, argvs], cwd=fresh, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    child = json.loads(proc.stdout.splitlines()[-1])
    ours = _run_here(here, capsys, monkeypatch)
    for (argv, reads), got, want in zip(COMMANDS, child, ours):
        print(argv, got["loaded"])
        heavy = set(got["loaded"]) - {"pyarrow"} - ({"pandas"} if reads and "pyarrow" in got["loaded"] else set())
        assert not heavy, f"packkit {' '.join(argv)} imported {sorted(heavy)}"
        assert got["code"] == want["code"] == 0, argv
        assert got["stdout"].replace(str(fresh), str(here)) == want["stdout"], argv
    for name in ("out.arrow", "out.parquet", "tok.arrow"):
        assert (fresh / name).read_bytes() == (here / name).read_bytes(), name


def imported_after(argvs: list, modules: tuple) -> str:
    """The ``modules`` imported after ``cli.main`` ran each of ``argvs`` in a fresh interpreter (its output
    swallowed), as ``sorted`` prints them: ``"[]"`` when none."""
    code = ("import contextlib, io, sys\nfrom packkit import cli\n"
            f"for argv in {argvs!r}:\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "        cli.main(argv)\n"
            f"print(sorted(m for m in {modules!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip() or out.stderr


def test_help_and_a_refused_argument_import_no_numpy():
    """Regression: ``packkit --help`` imported numpy (0.11 -> 0.50 s of CPU against fd3b24d) because the command
    line read ``--overflow``'s default from :mod:`packkit.binpack` and ``--cp-layout``'s choices from
    :mod:`packkit.cp_plan`; their home is now :mod:`packkit.choices`, which imports nothing."""
    assert imported_after([['--help'], ['nocommand']], ('numpy', 'pyarrow', 'torch')) == "[]"


def test_waste_and_plan_import_no_ctypes_util():
    """Regression: ``packkit waste`` and ``plan`` imported ``ctypes.util`` (and through it ``subprocess``) at start,
    for :mod:`packkit.fileio`'s ``renameat2``, which only a written output needs: it is looked up then; and
    ``socket`` with :mod:`packkit.chat`, which only the Hub probe of a named tokenizer needs."""
    code = ("import sys\nimport packkit.cli.waste, packkit.cli.plan, packkit.chat\n"
            "print(sorted(m for m in ('ctypes.util', 'subprocess', 'socket') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


#: What ``packkit waste`` (the bundled sample) and ``plan --synthetic`` imported at start for nothing, found with
#: ``python -X importtime`` and cProfile against fd3b24d: ``{module: why it must stay out}``.
LAZY = {
    "packkit.weighting": "the sampler resolved no weighting (5 dataclasses); plan's --loss-weighting choices",
    "packkit.chat": "ChatOptions for the bundled sample, which has no chat; CHAT_FORMATS for --format's choices",
    "packkit.fileio": "png_figure and check_plot for a --plot not asked for; held_still for a file not read",
    "packkit.listcolumns": "the readers of Arrow list columns, for a file not read",
    "numpy.ma": "np.percentile's np.unique imports it (10 ms of CPU) for waste's median, p90 and p99",
    "shutil": "argparse's HelpFormatter imports it (with lzma and bz2) for the terminal width, per add_argument",
    "packkit.datafiles": "the door in (34 KB to compile), for the bundled sample or --synthetic: no file is read",
    "packkit.jsonlines": "the JSON-lines engine (20 KB), through datafiles, for no file",
    "packkit.readers": "the readers of parquet, arrow, npy and text (12 KB), through datafiles, for no file",
    "packkit.tokenizer": "the tokenizers (16 KB), through datafiles, for no text",
    "packkit.cp_plan": "the CP planner (37 KB to compile from source) for a window check (packkit.cp_layouts)",
    "packkit.balance": "the cost-target planners and LPT (33 KB), through the sampler, for no balance='compute'",
    "packkit.rules": "the rules of whole examples (22 KB), through binpack, for as_lengths (packkit.length_rules)",
    "packkit.states": "the reader of saved states (7 KB), through the sampler, for a resume: no state is loaded",
    "packkit.resume": "the states a sampler saves and loads and the loaders' counts (20 KB), for no pass nor resume",
    "packkit.orders": "the length-grouped and token-budget samplers' sorts (8 KB), for plan's packed windows",
    "packkit.config_costs": "the sums of a model config (4 KB, CostModel.from_config), for the default cost weight",
    "packkit.groups": "the groups that stay in one window (5 KB, binpack.pack_groups), for packing without groups",
    "packkit.microbatch": "the largest micro-batch that fits (5 KB, budget.find_max_micro_batch), for a plan",
    "packkit.fits": "the planner's first-fit and next-fit strategies (5 KB), for plan's best fit (the default)",
}


@pytest.fixture(scope="module")
def started():
    """``{command: {module: its source file}}`` after ``packkit waste`` and ``plan --synthetic 500``, each in a fresh
    interpreter (``python -m packkit.cli``'s path: ``cli.main``)."""
    code = ("import contextlib, io, json, sys\nfrom packkit import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    code = cli.main(sys.argv[1:])\n"
            "print(json.dumps([code, {m: getattr(v, '__file__', None) for m, v in sys.modules.items()}]))")
    out = {}
    for argv in (["waste"], ["plan", "--synthetic", "500"]):
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        code_, modules = json.loads(proc.stdout.splitlines()[-1])
        assert code_ == 0, proc.stdout
        out[" ".join(argv)] = modules
    return out


#: Kept off ``plan --synthetic``'s path only: ``waste`` measures padded batches too (a LengthGroupedSampler), so it runs
#: the padded samplers' sorts and epochs and their short last step, every strategy of the planner (first fit and next
#: fit too) and the stream planner.
PLAN_ONLY = {"packkit.orders", "sort_megabatches", "budget_batch_bounds", "stable_argsort", "packkit.fits",
             "first_fit_decreasing", "first_fit", "next_fit", "default_mult", "tail_units", "stream_windows",
             "check_buffer_size", "deal_partial", "halve_pieces", "split_pieces"}


def _commands(started, name) -> dict:
    return {c: m for c, m in started.items() if name not in PLAN_ONLY or c.startswith("plan")}


@pytest.mark.parametrize("module", sorted(LAZY))
def test_waste_and_plan_start_without(started, module):
    for command, modules in _commands(started, module).items():
        assert module not in modules, f"packkit {command} imported {module}: {LAZY[module]}"


#: What ``packkit waste`` and ``plan --synthetic`` compiled from source at start and never ran, found by tracing the
#: functions each command calls against those its modules define (``{function: why it must stay out}``; a leading
#: ``_`` is not part of the name, so a function that moves and loses it is still found).
UNCOMPILED = {
    "read_state": "the check of a saved state's every field (4 KB of the sampler), for no resume",
    "consumed": "the count of the batches a DataLoader handed the loop (3 KB of the sampler), for no state saved",
    "asking_loader": "the DataLoader iterator that drives a pass (2 KB of the sampler), for no pass iterated",
    "point_after": "the position a state records, for no state saved",
    "sort_megabatches": "the padded samplers' sorts longest first (8 KB with the next two), for packed windows",
    "budget_batch_bounds": "the token-budget sampler's batches, for packed windows",
    "stable_argsort": "the padded samplers' radix argsort, for packed windows",
    "encoder_work": "a multimodal config's encoder sized (CostModel.from_config), for no model config given",
    "as_groups": "the groups of examples as CSR (binpack), for packing without groups",
    "split_groups": "a group longer than the window cut between its examples (binpack), for no groups",
    "find_max_micro_batch": "the bisection of a training step's micro-batch (budget), for a plan's figures",
    "classify": "the verdict on an error (packkit.cli._failures), for a command that fails nowhere",
    "install_hint": "the pip line of a missing package, read from packkit's metadata, for no import failing",
    "extra_for": "the extra that installs a module (with install_hint), for no import failing",
    "first_fit_decreasing": "first-fit decreasing (binpack), for plan's best fit; waste measures it",
    "first_fit": "first fit in a seeded order, item by item (binpack), for plan's best fit",
    "next_fit": "next fit in order (binpack), for plan's best fit",
    "deal_partial": "the deal of a step shorter than a full one (3 KB of the sampler with the next two), for plan's "
                    "epoch of whole steps (one window a step)",
    "halve_pieces": "a short step's units split by examples for more ranks than units, for no short step",
    "split_pieces": "a short step's pieces repeated for ranks left without one, for no short step",
    "dealt_units": "the units another world size's deal had handed out (the sampler), for no resume",
    "deal_step": "a step in progress dealt again at a loaded position (the sampler), for no resume",
    "unpickle_pass": "a pass rebuilt from a pickle (the sampler, with the pass itself), for no pass iterated",
    "to_cost": "the windows built to a cost target (the sampler's balance='compute' at k <= 2), for no balance",
    "default_mult": "the length-grouped sampler's megabatch (the sampler, with its epoch), for plan's packed windows",
    "tail_units": "the token-budget sampler's tail (the sampler, with its epoch), for plan's packed windows",
    "stream_windows": "best fit inside a bounded buffer (binpack, 5 KB with its buffer), for plan's whole dataset",
    "check_buffer_size": "the stream planner's buffer checked (binpack), for no stream",
    "start": "a pass's first batch asked for: the pass in progress, its warnings (1.2 KB of the sampler), for no pass",
}


def _defined(path: str) -> set:
    """Every function, method and class name ``path`` defines (a leading ``_`` dropped)."""
    tree = ast.parse(Path(path).read_text())
    return {n.name.lstrip("_") for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("function", sorted(UNCOMPILED))
def test_waste_and_plan_compile_no_code_they_never_run(started, function):
    """Regression: the sampler held its resume code (the states saved and loaded, the loaders' counts: 20 KB) and the
    padded samplers' sorts (8 KB) among what ``plan`` and ``waste`` deal packed windows with, so both compiled them
    at every start from source (``plan --synthetic`` 1.10x fd3b24d's CPU). They are :mod:`packkit.resume`, imported
    at a sampler's first pass or state, and :mod:`packkit.orders`, where a padded sampler builds an epoch.
    Regression too (round 6): ``plan`` still compiled the sampler's deal of a short step (which a step of one window
    never has), the step in progress dealt again at a resume, the pass, the windows built to a cost target and the
    padded samplers' epochs (15 M of ``plan --synthetic 2000``'s 721 M instructions from source, callgrind), and
    binpack's stream planner (7 M). They are :mod:`packkit.short_steps`, :mod:`packkit.resume`, :mod:`packkit.balance`,
    :mod:`packkit.orders` and :mod:`packkit.streamplan` (``waste`` measures the stream planner and the padded
    samplers)."""
    for command, modules in _commands(started, function).items():
        where = [m for m, path in modules.items() if m.startswith("packkit") and path and function in _defined(path)]
        assert not where, f"packkit {command} compiled {function} ({', '.join(where)}): {UNCOMPILED[function]}"


#: The views of a plan that planning never takes: :class:`~packkit.binpack.Plan`'s methods of these names call
#: :mod:`packkit.planviews` (imported where a plan is viewed), so their code is not compiled with the planner.
PLAN_VIEWS = ("window_range", "keep_segments", "chunks", "summary", "__repr__")


def test_waste_and_plan_compile_no_view_of_a_plan():
    """Regression (round 7): binpack compiled the views of a :class:`~packkit.binpack.Plan` with the planner (a range of
    windows, segments dropped, chunks of a token budget, the summary, the repr: 3.3 KB of code, 2.7 M of ``plan
    --synthetic 2000``'s 694 M instructions from source, callgrind), none of which ``plan`` or ``waste`` runs. Each
    method keeps its name and docstring and calls :mod:`packkit.planviews`; the same plans and figures come out."""
    from packkit import binpack, planviews

    tree = ast.parse(Path(binpack.__file__).read_text())
    plan = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Plan")
    bodies = {n.name: n.body for n in plan.body if isinstance(n, ast.FunctionDef) and n.name in PLAN_VIEWS}
    assert sorted(bodies) == sorted(PLAN_VIEWS)
    for name, body in bodies.items():
        code = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        assert len(code) == 1 and isinstance(code[0], ast.Return), f"Plan.{name} holds its code: {PLAN_VIEWS}"
    p = binpack.pack([5, 3, 4, 2], window=8)
    assert p.chunks(8) == planviews.chunks(p, 8) == [(0, 1), (1, 2)]
    assert p.summary()["windows"] == 2 and repr(p).startswith("Plan(strategy='bfd', window=8")
    assert p.window_range(1, 2).num_windows == 1 and p.keep_segments([True] * p.num_segments).num_windows == 2


def test_the_command_module_is_imported_with_the_collector_paused():
    """Regression: the cyclic garbage collector ran among the objects the command's import allocates (numpy's,
    packkit's), which live as long as the process: 3.5% of ``plan --synthetic``'s instructions. It is paused
    for that import and collects again when the command runs (and stays off if the caller had turned it off)."""
    code = ("import contextlib, gc, importlib, io, sys\nfrom packkit import cli\n"
            "seen = []\nimport_module = importlib.import_module\n"
            "def spy(name, *a):\n    seen.append((name, gc.isenabled()))\n    return import_module(name, *a)\n"
            "importlib.import_module = spy\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    cli.main(['plan', '--synthetic', '200'])\n    after = gc.isenabled()\n"
            "    gc.disable()\n    cli.main(['waste'])\n"
            "print(seen, after, gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[('packkit.cli.plan', False), ('packkit.cli.waste', False)] True False", out.stdout


def test_the_command_freezes_what_its_import_made_only_as_the_process():
    """Regression: after the command's import the collector ran again over every object the import had made
    (they live as long as the process) each time the command's own work triggered a collection: 7% of ``plan
    --synthetic``'s instructions (533 M -> 494 M under valgrind). As the process (``main()`` reading ``sys.argv``,
    as ``packkit`` and ``python -m packkit.cli`` call it) they are frozen (``gc.freeze``); a call of ``main(argv)``
    from Python freezes nothing (the caller's garbage cycles would never be collected), nor does a process that
    turned the collector off."""
    code = ("import contextlib, gc, io, sys\nfrom packkit import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    cli.main(['plan', '--synthetic', '200'])\n    called = gc.get_freeze_count()\n"
            "    sys.argv = ['packkit', 'waste']\n    code = cli.main()\n"
            "print(code, called, gc.get_freeze_count() > 1000, gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0 0 True True", out.stdout + out.stderr
    off = code.replace("from packkit import cli", "from packkit import cli\ngc.disable()")
    out = subprocess.run([sys.executable, "-c", off], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0 0 False False", out.stdout + out.stderr


@pytest.mark.parametrize("columns", [None, "0", "x", "37", "200"])
def test_help_is_as_wide_as_argparse_makes_it(monkeypatch, columns):
    """The formatter that reads the width without shutil gives argparse's width: ``COLUMNS`` when a positive
    integer, else the terminal's, else 80 (the tests' stdout is no terminal)."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    assert cli._Formatter("packkit")._width == argparse.RawDescriptionHelpFormatter("packkit")._width
    ours, stock = plan_command.parser(), plan_command.parser()
    stock.formatter_class = argparse.RawDescriptionHelpFormatter
    assert ours.format_help() == stock.format_help()


def test_the_words_of_the_lazy_modules_are_theirs():
    """``--loss-weighting`` and ``--format`` take their choices from :mod:`packkit.choices` (imports nothing) so
    that ``plan`` and ``waste`` start without :mod:`packkit.weighting` and :mod:`packkit.chat`: the same words."""
    from packkit import chat, choices, weighting

    assert choices.LOSS_WEIGHTINGS == tuple(sorted(weighting.NAMES))
    assert chat.CHAT_FORMATS is choices.CHAT_FORMATS


def test_help_imports_no_dataclasses():
    """Regression: ``packkit --help`` imported dataclasses (and inspect, ast, dis, tokenize with it) through
    :mod:`packkit.errors`, whose ``with_keywords`` alone uses it: 157 M instructions against fd3b24d's 103 M
    (valgrind, bytecode cached), 1.5x its CPU; 115 M without."""
    code = ("import contextlib, io, sys\nfrom packkit import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    cli.main(['--help'])\n"
            "print(sorted(m for m in ('dataclasses', 'inspect') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_tokenize_and_pack_import_no_sampler():
    """Regression (review of 274f91b's moves): the door in read ``Lengths`` from :mod:`packkit.epoch`, which imported
    the sampler at the top (with ``balance``, ``weighting`` and ``states``' users): ``packkit tokenize`` and ``pack``,
    which deal no epoch, started 17% slower. ``epoch`` deals through the sampler on demand."""
    code = ("import sys\nimport packkit.cli.tokenize, packkit.cli.pack\n"
            "print(sorted(m for m in ('packkit.sampler', 'packkit.balance', 'packkit.weighting') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_plan_of_token_ids_imports_no_chat_templates(tmp_path):
    """Regression: ``packkit plan FILE`` built its :class:`~packkit.chatoptions.ChatOptions` from :mod:`packkit.chat`,
    so a file of token ids compiled the chat templates at start (``chat``, ``chatrender`` and transformers'
    compiler: 67 KB from source; ``plan small.jsonl`` 1.04x fd3b24d's CPU). The options have a room of their own;
    the templates are imported where a conversational file is read."""
    _inputs(tmp_path)
    code = ("import contextlib, io, sys\nfrom packkit import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    code = cli.main(['plan', 'in.jsonl', '-w', '64'])\n"
            "print(code, sorted(m for m in ('packkit.chat', 'packkit.chatrender', 'packkit.integrations.transformers')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0 []", out.stdout + out.stderr


def test_help_version_and_a_wrong_command_import_no_errors_module():
    """Regression: ``packkit --help`` compiled :mod:`packkit.errors` (13 KB, and ``numbers``) for the classifying of
    errors it never raises: 166.7 M instructions from source against fd3b24d's 134.1 M (valgrind), 1.18-1.20x its
    CPU; 149 M now. The command line imports it where an error or a warning is shown; every subcommand has it."""
    assert imported_after([['--help'], ['--version'], ['nocommand'], []], ('packkit.errors', 'numbers')) == "[]"


def test_help_version_and_a_wrong_command_compile_no_shared_options_nor_failures():
    """Regression: ``packkit --help`` compiled the whole command line (19 KB from source): the options the subcommands
    share, their parser and the verdicts on every error, none of which it runs, with :mod:`packkit.choices` for the
    options' words: 149.4 M instructions from source against fd3b24d's 134.2 M (valgrind), 127.7 M now. They are
    :mod:`packkit.cli._options` (imported with a subcommand) and :mod:`packkit.cli._failures` (where a command fails),
    lent by :mod:`packkit.cli` under their old address."""
    assert imported_after([['--help'], ['--version'], ['nocommand'], []],
                          ('packkit.cli._options', 'packkit.cli._failures', 'packkit.choices')) == "[]"


def test_the_command_line_lends_what_moved_under_its_old_address():
    """``packkit.cli.Parser``, ``classify``, ``install_hint`` and the other names that left for
    :mod:`packkit.cli._options` and :mod:`packkit.cli._failures` are the same objects at their old address."""
    from packkit.cli import _failures, _options

    for name, home in cli._LENT.items():
        assert getattr(cli, name) is getattr({"_options": _options, "_failures": _failures}[home], name), name
    with pytest.raises(AttributeError):
        cli.no_such_name  # noqa: B018


def _plan_and_waste_of_a_file(tmp_path, report: str) -> subprocess.CompletedProcess:
    """``packkit plan`` and ``waste`` of a small file of token ids in a fresh interpreter, their exit codes in
    ``codes``, then the Python line ``report`` (``json`` and ``sys`` imported)."""
    _inputs(tmp_path)
    code = ("import contextlib, io, json, sys\nfrom packkit import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    codes = [cli.main(['plan', 'in.jsonl', '-w', '64']), cli.main(['waste', 'in.jsonl', '-w', '64'])]\n"
            + report)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)


def test_plan_and_waste_of_token_ids_import_no_tokenizers(tmp_path):
    """Regression: the door in (:mod:`packkit.datafiles`) imported :mod:`packkit.tokenizer` at the top (14 KB from source)
    for text and preference pairs to tokenize, so ``packkit plan FILE`` and ``waste FILE`` of token ids compiled the
    tokenizers' loading at start. It is imported where text is tokenized or a tokenizer named; ``datafiles.tokenize``
    and the other names are lent as before."""
    out = _plan_and_waste_of_a_file(tmp_path, "print(codes, 'packkit.tokenizer' in sys.modules)")
    assert out.stdout.strip() == "[0, 0] False", out.stdout + out.stderr
    from packkit import datafiles, tokenizer

    for name in ("load_tokenizer", "rust_tokenizer", "tokenize", "tokenizer_name"):
        assert getattr(datafiles, name) is getattr(tokenizer, name), name


#: What ``packkit plan FILE`` and ``waste FILE`` of token ids (no float, no long line, nothing refused) imported at
#: start and never ran, found by callgrind against fd3b24d (round 8): ``{module: why it must stay out}``.
FILE_LAZY = {
    "packkit.located": "the errors that name an example (4.1 M instructions to compile), for a file that reads",
    "packkit.jsonblame": "the line to blame where pyarrow refuses JSON lines (6 KB), for a file that reads",
    "packkit.longline": "one line of 8 MiB or more parsed on many threads, for short lines",
    "packkit.tokenizing": "text and conversations given their token column, for token ids",
    "packkit.allocators": "the memory a tokenized chunk freed handed back (1.5 M), for nothing tokenized",
}


def test_plan_and_waste_of_token_ids_import_none_of_the_error_paths(tmp_path):
    """Regression (round 8): ``packkit plan FILE`` and ``waste FILE`` of token ids imported :mod:`packkit.located`
    through :mod:`packkit.rules` (and the door in) for the errors about an example they never raise,
    :mod:`packkit.allocators` with the door in for chunks tokenized, and the error and long-line paths of
    :mod:`packkit.jsonlines` and the door in's tokenizing with their modules. Each is imported where it is taken; the
    names are lent at their old address (``packkit.rules.ExampleValueError``)."""
    out = _plan_and_waste_of_a_file(tmp_path, f"print(json.dumps([codes, [m for m in {sorted(FILE_LAZY)!r} "
                                              "if m in sys.modules]]))")
    codes, loaded = json.loads(out.stdout.splitlines()[-1])
    assert codes == [0, 0], out.stdout + out.stderr
    assert not loaded, "; ".join(f"packkit plan/waste FILE imported {m}: {FILE_LAZY[m]}" for m in loaded)


#: What ``packkit plan FILE`` and ``waste FILE`` of token ids compiled from source at start and never ran, found as
#: :data:`UNCOMPILED` (``{function: why it must stay out}``).
FILE_UNCOMPILED = {
    "atomic_output": "the output side of packkit.fileio (19 M instructions of plan small.jsonl's start), for no output",
    "check_output": "the checks of an output path (packkit.fileio), for a command that writes nothing",
    "png_figure": "a plot written as a PNG (packkit.fileio), for no --plot",
    "row_segments": "a packed row's documents checked (packkit.rules, 24 KB with the next four: 28 M of plan "
                    "small.jsonl's instructions), for a file of plain examples",
    "check_groups": "a group's completions checked (packkit.rules), for no preference pairs nor RL groups",
    "relocate_part": "an error about a completion said of its group (packkit.rules), for no groups",
    "example_values": "per-example values checked (packkit.rules: advantages, weights), for none",
    "grid_rows": "an image's or a video's grid checked (packkit.rules), for no media",
    "read_npy": "the readers of Parquet, Arrow, npy, text and folders (packkit.readers, imported by the door in: 11 M "
                "instructions), for a JSON lines file",
    "parquet_batches": "a Parquet file read a batch at a time (packkit.readers), for a JSON lines file",
    "text_byte_lengths": "a text file's lines counted in bytes (packkit.readers), for a JSON lines file",
    "locate_error": "the line to blame where pyarrow refuses JSON lines (packkit.jsonlines' error path, 6 KB with the "
                    "next two), for a file that reads",
    "json_kind": "the JSON kind of a value, to name one that changes from line to line (packkit.jsonlines), for no "
                 "error",
    "first_float": "the row of a float token, blamed on its line (packkit.jsonlines), for no float",
    "one_long_line": "one line of 8 MiB or more parsed on many threads (packkit.jsonlines, 2.5 KB), for short lines",
    "Tokenizing": "how rows get their token column, text or conversations (packkit.datafiles, 4 KB), for token ids",
}


@pytest.mark.parametrize("function", sorted(FILE_UNCOMPILED))
def test_plan_and_waste_of_a_file_compile_no_code_they_never_run(tmp_path, function):
    """Regression (round 6): ``packkit plan FILE`` and ``waste FILE`` imported :mod:`packkit.fileio` for
    :func:`~packkit.fileio.held_still` (the input held still while read) and compiled its output side too (the atomic
    writes, the checks of an output path, the plots: 29 KB, 19 M of ``plan small.jsonl``'s 1,733 M instructions from
    source). The output side is :mod:`packkit.atomic`, lent by :mod:`packkit.fileio` under its old address.
    Regression too (round 7): both compiled every rule of :mod:`packkit.rules` (37 KB), 24 KB of which a file of plain
    token ids never runs: a packed row's documents, groups, per-example values, media grids. They are
    :mod:`packkit.row_rules` (the errors that name an example, below both, :mod:`packkit.located`), lent by
    :mod:`packkit.rules` under their old address; and the readers of the other formats (:mod:`packkit.readers`, 11 KB),
    which the door in imported at the top: imported where such a file is read, lent by :mod:`packkit.datafiles`.
    Regression too (round 8): :mod:`packkit.jsonlines` compiled the line to blame for a refused file (the kinds of JSON
    values, Python's reading of every line, a float token's row) and the parse of one line of 8 MiB or more (9 KB of
    its 13 KB of code, none of which a file that reads runs). They are :mod:`packkit.jsonblame` and
    :mod:`packkit.longline`, imported where taken, the names lent by :mod:`packkit.jsonlines`; and the door in compiled
    :class:`~packkit.datafiles.Tokenizing` (text and conversations tokenized), now :mod:`packkit.tokenizing`, lent."""
    out = _plan_and_waste_of_a_file(
        tmp_path, "print(json.dumps([codes, {m: getattr(v, '__file__', None) for m, v in sys.modules.items()}]))")
    codes, modules = json.loads(out.stdout.splitlines()[-1])
    assert codes == [0, 0], out.stdout + out.stderr
    where = [m for m, path in modules.items() if m.startswith("packkit") and path and function in _defined(path)]
    assert not where, f"packkit plan/waste FILE compiled {function} ({', '.join(where)}): {FILE_UNCOMPILED[function]}"


def test_the_moved_names_are_lent_under_their_old_address():
    """What left :mod:`packkit.sampler`, :mod:`packkit.binpack`, :mod:`packkit.fileio`, :mod:`packkit.rules`,
    :mod:`packkit.datafiles` and :mod:`packkit.jsonlines` for rooms of their own is the same object at its old
    address."""
    from packkit import atomic, binpack, fileio, length_rules, sampler, short_steps, streamplan

    for name in ("halve_pieces", "split_pieces"):
        assert getattr(sampler, name) is getattr(short_steps, name)
    for name in ("stream_windows", "StreamBuffer", "check_buffer_size"):
        assert getattr(binpack, name) is getattr(streamplan, name)
    assert binpack.check_window is length_rules.check_window and binpack.MAX_WINDOW == length_rules.MAX_WINDOW
    for name in atomic.__all__:
        assert getattr(fileio, name) is getattr(atomic, name), name
    with pytest.raises(AttributeError):
        fileio.no_such_name  # noqa: B018
    from packkit import located, row_rules, rules

    for name in row_rules.__all__:
        assert getattr(rules, name) is getattr(row_rules, name), name
    for name in ("location", "where_of", "located", "relocate", "ExampleValueError", "ExampleTypeError", "not_integral",
                 "_Located", "_located_again"):
        assert getattr(rules, name) is getattr(located, name), name
    with pytest.raises(AttributeError):
        rules.no_such_name  # noqa: B018
    from packkit import arrow, datafiles, readers

    for name, home in datafiles._LENT.items():
        assert getattr(datafiles, name) is getattr(importlib.import_module(f"packkit.{home}"), name), name
    assert readers.replay is arrow.replay
    from packkit import jsonblame, jsonlines

    from packkit import tokenizing

    assert datafiles.Tokenizing is tokenizing.Tokenizing
    for name in rules._LOCATED:
        assert getattr(rules, name) is getattr(located, name), name
    for name in jsonlines._BLAME:
        assert getattr(jsonlines, name) is getattr(jsonblame, name), name
    with pytest.raises(AttributeError):
        jsonlines.no_such_name  # noqa: B018
