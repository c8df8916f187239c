"""mkdocs hook: let mkdocstrings find ``multidc.*`` in this checkout.

The three packages live at the repository root (``hierarchical/``, ``strategies/``, ``plugins/``) and install as
``multidc.hierarchical`` etc. through a ``package-dir`` mapping, which griffe's static finder cannot follow. This
links them under ``build/docs-src/multidc/`` (the handler's ``paths`` in ``mkdocs.yml``) when mkdocs loads the
hook, before mkdocstrings looks at its paths.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hierarchical", "strategies", "plugins")


def link_packages(root: Path = ROOT) -> Path:
    """Create ``<root>/build/docs-src/multidc/<package>`` links (idempotent); return ``build/docs-src``."""
    target = root / "build" / "docs-src" / "multidc"
    target.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        link = target / name
        if not link.is_symlink():
            try:
                os.symlink(root / name, link, target_is_directory=True)
            except FileExistsError:  # a build running beside this one made it
                pass
    return target.parent


link_packages()
