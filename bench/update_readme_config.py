#!/usr/bin/env python
"""Rewrite the config table at the end of README.md from the pydantic models (run after edits)."""

from pathlib import Path

from quiver_serve.config import REPO_ROOT, reference_markdown

readme = Path(REPO_ROOT / "README.md")
text = readme.read_text()
start = text.index("| key | default | description |")
end = text.find("\n\n", start)
tail = "" if end == -1 else text[end:]
readme.write_text(text[:start] + reference_markdown() + (tail or "\n"))
print("README config reference updated")
