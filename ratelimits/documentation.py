"""Where the documentation lives, so that a message can send its reader to a page from an installed wheel.

The pages are the repository's docs/*.md, which MkDocs builds into a site (mkdocs.yml). A message
that points at ``docs/metrics.md`` means nothing to a project that installed the package: one that
gives ``page("metrics", "several-worker-processes-multiprocess-mode")`` names an address anyone can
open. tests/test_documentation.py checks that every such address names a page and an anchor the
built site has.
"""

from __future__ import annotations

#: The built site, as published (an assumed address until the project has a public home: it is
#: pyproject.toml's Documentation URL).
SITE = "https://django-ratelimits.readthedocs.io/en/latest/"


def page(name: str, section: str = "") -> str:
    """The address of docs/``name``.md in the site, at the heading whose anchor is ``section`` if given.

    An anchor is GitHub's slug of the heading: lower case, punctuation dropped, spaces as hyphens.
    """
    return f"{SITE}{name}.html" + (f"#{section}" if section else "")
