"""The embedded default corpus: the documentation text that ships with CPython itself.

`pydoc_data.topics` holds the language reference topics `help()` shows (~0.5 MB of English
prose and code), present in every CPython install, so the main job and the tests need no download.
"""

from __future__ import annotations

from collections.abc import Iterator


def embedded_documents() -> Iterator[str]:
    """Yields one document per pydoc topic, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield text
