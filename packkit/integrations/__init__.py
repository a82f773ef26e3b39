"""Where packkit touches a framework's private surface: one module per framework, so an upgrade of it has one
place to break. Each declares the versions it is checked against (``SUPPORTED``) and
``tests/test_integrations.py`` checks the installed version against it and the hooks it uses against the
installed framework.

* :mod:`packkit.integrations.transformers`: attention functions (``AttentionInterface``), the keyword
  arguments a model's attention layer passes them, and the layouts of their tensors.
"""
