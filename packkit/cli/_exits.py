"""The ``packkit`` command's exit codes (:data:`EXIT_CODES`, printed by every ``--help``) and :class:`UsageError`, in a
module that imports nothing (``packkit --help`` compiles no more than it prints)."""

EXIT_OK, EXIT_BUG, EXIT_USAGE, EXIT_DATA, EXIT_SYSTEM = 0, 1, 2, 3, 4
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141

EXIT_CODES = """exit codes:
  0    success
  1    a bug in packkit (a traceback is printed: please report it)
  2    usage: the command line is wrong (bad option or value, OUT exists or is IN)
  3    data: the input cannot be read or holds an example packkit refuses
  4    system: a missing optional package, out of memory, disk full
  130  interrupted (143 SIGTERM, 129 SIGHUP); 141 the output pipe was closed (quietly)"""

class UsageError(Exception):
    """The command line is wrong: one line, exit code 2."""
