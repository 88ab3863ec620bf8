"""Config translation: one set of field names in, the installed release's config dataclass out.

``fields`` is the GENERATED record of every config dataclass's fields per release (``scripts/gen_config_fields.py``
from the wheels); ``names`` answers lookups over it (which fields a class has at a release, renames, close
matches); ``effects`` is the hand-kept table of fields that are harmless to drop where a release lacks them (with
the reason); ``translate`` turns a user's fields into the release's (renames applied, harmless ones dropped with a
warning, anything else refused naming the field and the releases that have it). The public entry point is
:mod:`mcore_compat.configs`.
"""
