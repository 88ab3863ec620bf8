"""Version knowledge: what each Megatron-Core release has, in one table per concern.

The story of one version fact: a release range (``ranges``: ``">=0.9,<0.14"`` syntax, ``in_range``) is the key of
a row, and a row (``rows``: ``Fact``, ``Symbol``, ``Location``) says what holds over that range. The rows live in
tables: ``table`` (every fact the code reads - signatures, defaults, layout rules - ``FACTS``), ``symbol_table``
(where each surface symbol lives per release), ``surface_data`` (every importable name of ``megatron.core`` per
release, GENERATED from the wheels by ``scripts/gen_surface.py``). Each row of ``table`` carries a probe
(``probes``, ``layout_probes``: ``inspect`` on modules that import everywhere, ``ast`` on the rest) that the matrix
sessions run against the installed release, so a table that disagrees with a real wheel fails CI. ``surface_read``
reads the surface data, ``mirror`` builds the lazy ``mcore_compat.core`` mirror from it, and ``fallbacks`` holds
our own implementations of the symbols a release lacks (the symbol table points there). The public readers are
:mod:`mcore_compat.capabilities` (``fact``/``has``), :mod:`mcore_compat.symbols` and :mod:`mcore_compat.surface`.
"""
