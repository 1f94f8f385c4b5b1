"""A griffe extension for the API reference: the docstrings' `Example:` sections are read as
Google-style `Examples:` sections, so their `>>>` lines render as code, not as Markdown."""

from __future__ import annotations

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
