"""A griffe extension for the API reference: dpcore's docstrings are prose written with Sphinx's
RST roles (:class:`~dpcore.ledger.PrivacyLedger`, :func:`x`, ...), which Markdown would show
verbatim. Each role becomes a code span of what Sphinx would display (the last component with
``~``, the text of ``text <target>``), so the reference reads as the source means it."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const|ref|term):`([^`]+)`")


def _shown(target: str) -> str:
    m = re.fullmatch(r"(.*?)\s*<([^>]+)>", target)
    if m:
        return m.group(1)
    if target.startswith("~"):
        return target[1:].rsplit(".", 1)[-1]
    return target.lstrip("!")


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        doc = getattr(obj, "docstring", None)
        if doc is not None and ":" in doc.value:
            doc.value = _ROLE.sub(lambda m: f"`{_shown(m.group(1))}`", doc.value)
