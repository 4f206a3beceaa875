"""MkDocs hook: the site's front page is README.md (docs/index.md includes it), whose
links point at repository files outside docs/ (the benchmark charts). Add those files
to the site at the same relative paths, so the links work there as on the repository."""

from __future__ import annotations

import os
import re

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

# Markdown link/image targets without a scheme or fragment: ](path/to/file.png)
_LINK = re.compile(r"\]\(([^)#\s:]+)\)")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        targets = sorted(set(_LINK.findall(f.read())))
    for target in targets:
        # A target that is missing stays a broken link: `mkdocs build --strict` reports it.
        if files.get_file_from_path(target) is None and os.path.isfile(os.path.join(root, target)):
            files.append(
                File(target, src_dir=root, dest_dir=config.site_dir, use_directory_urls=config.use_directory_urls)
            )
    return files
