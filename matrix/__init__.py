"""Data files of the support matrix, installed as the package ``mcore_compat.matrix``.

``versions.toml`` (supported releases), ``results.json`` (recorded results) and the generated ``README.md``.
Read them through :mod:`mcore_compat.support`.
"""
