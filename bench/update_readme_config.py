"""Rewrite the config table at the end of README.md from the pydantic models (run after edits).

    python -m bench.update_readme_config
"""

import argparse
from pathlib import Path


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    from quiver_serve.config import REPO_ROOT, reference_markdown

    readme = Path(REPO_ROOT / "README.md")
    text = readme.read_text()
    start = text.index("| key | default | description |")
    end = text.find("\n\n", start)
    tail = "" if end == -1 else text[end:]
    readme.write_text(text[:start] + reference_markdown() + (tail or "\n"))
    print("README config reference updated")


if __name__ == "__main__":
    main()
