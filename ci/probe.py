"""What a base venv has installed, run by that venv's interpreter (``python -I ci/probe.py ...``).

Commands (the answer is one JSON document on stdout):

* ``unmet REQS_JSON``: the requirements of the JSON list that are missing or at a version outside their specifier,
  each as ``"<requirement> (missing)"`` or ``"<requirement> (have <version>)"``.
* ``versions NAMES_JSON``: ``{"python": "3.11.7", "dists": {name: version or null}}``.

Only the standard library and ``packaging`` (which every base has) are imported.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import sys


def unmet(requirements: list[str]) -> list[str]:
    """The requirements this interpreter does not satisfy (pre-releases count as satisfying)."""
    from packaging.requirements import Requirement

    bad: list[str] = []
    for text in requirements:
        req = Requirement(text)
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            bad.append(text + " (missing)")
            continue
        if not req.specifier.contains(have, prereleases=True):
            bad.append(f"{text} (have {have})")
    return bad


def versions(names: list[str]) -> dict[str, object]:
    """This interpreter's version and the installed version of each distribution (``None``: not installed)."""
    have: dict[str, str | None] = {}
    for name in names:
        try:
            have[name] = md.version(name)
        except md.PackageNotFoundError:
            have[name] = None
    return {"python": platform.python_version(), "dists": have}


def main(argv: list[str]) -> int:
    """Run one command; see the module docstring."""
    if len(argv) != 2 or argv[0] not in ("unmet", "versions"):
        print("usage: probe.py {unmet,versions} JSON_LIST", file=sys.stderr)
        return 2
    answer = unmet(json.loads(argv[1])) if argv[0] == "unmet" else versions(json.loads(argv[1]))
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
