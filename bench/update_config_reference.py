"""Rewrite the config table of docs/config.md from the pydantic models (run after editing a field).

    python -m bench.update_config_reference
"""

from pathlib import Path

from quiver_serve.config import reference_markdown

page = Path(__file__).resolve().parents[1] / "docs" / "config.md"
text = page.read_text()
start = text.index("| key | default | description |")
end = text.find("\n\n", start)
tail = "" if end == -1 else text[end:]
page.write_text(text[:start] + reference_markdown() + (tail or "\n"))
print("docs/config.md config reference updated")
