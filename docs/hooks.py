"""MkDocs hook: the pages link committed benchmark results (charts) that live outside
docs/, under benchmarks/results/. A page at the top of docs/ links one by its repository
path (``benchmarks/results/cpu/x.png``); this hook adds those files to the site at that
path, so the links resolve there."""

from __future__ import annotations

import glob
import os
import re

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

# Markdown link/image targets into the committed results: ](benchmarks/results/...)
_LINK = re.compile(r"\]\((benchmarks/results/[^)#\s]+)\)")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    targets: set[str] = set()
    for page in glob.glob(os.path.join(config.docs_dir, "*.md")):
        with open(page, encoding="utf-8") as f:
            targets.update(_LINK.findall(f.read()))
    for target in sorted(targets):
        # A target that is missing stays a broken link: `mkdocs build --strict` reports it.
        if files.get_file_from_path(target) is None and os.path.isfile(os.path.join(root, target)):
            files.append(
                File(target, src_dir=root, dest_dir=config.site_dir, use_directory_urls=config.use_directory_urls)
            )
    return files
